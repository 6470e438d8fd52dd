"""An AdamW state on disk that any world size reads back.

Each rank writes the moments it holds (its shard of every parameter's `exp_avg` and `exp_avg_sq`,
named `<parameter>.<moment>`) into its own safetensors file, in torch.distributed.checkpoint's
Hugging Face layout: the offsets of each piece are in the file's metadata, so a state saved by two
ranks loads into one or three, FSDP2 or DeepSpeed. `state.json` holds what is not a tensor: the step
count, the parameter group's hyperparameters and the LR schedule. Nothing is unpickled: the files
are tensors and JSON, and a value of the wrong kind is an error.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ppoflow.tasks.storage.safetensors_files import read_header, streamable, write_safetensors

MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_FILE = "state.json"
FORMAT = 1


class OptimizerStateError(ValueError):
    """A saved optimizer state that cannot be read into this optimizer."""


# --- the files ---------------------------------------------------------------------------------


def save_moments(directory: Path, moments: dict[str, torch.Tensor], *, distributed: bool) -> None:
    """Write `moments` (this rank's pieces; DTensors keep their offsets) into `directory`; with
    `distributed`, every rank of the process group calls it and writes its own file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    if not distributed:
        _write_one_file(Path(directory), moments)
        return
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=distributed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(moments, storage_writer=writer, no_dist=not distributed)
    except CheckpointException as error:  # a BaseException: unwrap what a rank raised (a full disk)
        raise _first_failure(error) from None
    if not distributed or dist.get_rank() == 0:  # every rank's file is written when save returns
        for path in sorted(Path(directory).glob("*.safetensors")):
            _sort_header(path)


ONE_FILE = "model-00001-of-00001.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _write_one_file(directory: Path, moments: dict[str, torch.Tensor]) -> None:
    """What torch.distributed.checkpoint's Hugging Face writer saves for one process, byte for byte,
    without its planning (tests/tasks/storage/test_optimizer_state.py checks the bytes): written from the
    moments' memory (safetensors_files.py), or by `save_file` with its header sorted afterwards when
    they are not of one dtype. Not fsynced here: whoever keeps the file makes it durable (a run's
    checkpoints are fsynced in the background, tasks/storage/durability.py)."""
    from safetensors.torch import save_file

    whole = {name: {"saved_offsets": [0] * tensor.dim()} for name, tensor in moments.items()}
    metadata = {"DCP_SHARDING_INFO": json.dumps(whole), "DCP_VERSION": "1.0", "format": "pt"}
    path = directory / ONE_FILE
    if streamable(moments, metadata):
        write_safetensors(path, moments, metadata, sort_keys=True)
    else:
        save_file(
            {name: tensor.detach().contiguous() for name, tensor in moments.items()}, path, metadata=metadata
        )
        _sort_header(path)
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in moments.values())},
        "weight_map": dict.fromkeys(moments, ONE_FILE),
    }
    with open(directory / INDEX_FILE, "w") as stream:
        json.dump(index, stream, indent=2)


def _first_failure(error: CheckpointException) -> BaseException:
    for failure, _ in error.failures.values():
        return failure
    return OSError(str(error))


def _sort_header(path: Path) -> None:
    """Rewrite a safetensors header with its keys sorted (same length, so the data does not move):
    the writer orders them differently in every process, and equal states must be equal files."""
    with open(path, "r+b") as f:
        read = read_header(f)
        if read is None:
            raise OptimizerStateError(f"{path} was just written without a safetensors header")
        length, header = read
        canonical = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        if len(canonical) > length:
            return
        f.seek(8)
        f.write(canonical.ljust(length, b" "))


def saved_names(directory: Path) -> set[str]:
    """The tensor names a saved state holds (from the files' headers)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    if not any(Path(directory).glob("*.safetensors")):
        return set()
    try:
        return set(HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata)
    except Exception as error:  # a damaged header
        raise OptimizerStateError(
            f"optimizer state in {directory} cannot be read: {_one_line(error)}"
        ) from None


def load_moments(directory: Path, targets: dict[str, torch.Tensor]) -> None:
    """Fill each target (a whole tensor, or this rank's DTensor shard) from the saved pieces, which
    must tile each moment exactly (no piece outside it, none overlapping, none missing); a moment
    read back must be finite (and exp_avg_sq non-negative)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    if not targets:
        return
    reader = HuggingFaceStorageReader(str(directory))
    try:
        _check_tiling(reader.read_metadata(), {name: tuple(t.shape) for name, t in targets.items()})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(targets, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as error:  # a damaged file or a piece that does not fit
        raise OptimizerStateError(
            f"optimizer state in {directory} cannot be read: {_one_line(error)}"
        ) from None
    for name, tensor in targets.items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if not torch.isfinite(local).all() or (name.endswith("exp_avg_sq") and (local < 0).any()):
            raise OptimizerStateError(
                f"optimizer state in {directory}: {name} holds values no AdamW state has"
            )


def _check_tiling(metadata, shapes: dict[str, tuple[int, ...]]) -> None:
    for name, shape in shapes.items():
        saved = metadata.state_dict_metadata.get(name)
        if saved is None:
            raise OptimizerStateError(f"{name} is not saved")
        if tuple(saved.size) != shape:
            raise OptimizerStateError(
                f"{name} is saved with shape {tuple(saved.size)}, the model's is {shape}"
            )
        boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in saved.chunks]
        for offsets, sizes in boxes:
            if any(o < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape, strict=True)):
                raise OptimizerStateError(f"a piece of {name} lies outside it (offsets {list(offsets)})")
        for i, (a, a_sizes) in enumerate(boxes):
            for b, b_sizes in boxes[i + 1 :]:
                if all(x < y + m and y < x + n for x, n, y, m in zip(a, a_sizes, b, b_sizes, strict=True)):
                    raise OptimizerStateError(f"two pieces of {name} overlap")
        if sum(math.prod(sizes) for _, sizes in boxes) != math.prod(shape):
            raise OptimizerStateError(f"the pieces of {name} do not cover it")


def _one_line(error: BaseException) -> str:
    if isinstance(error, CheckpointException):
        error = _first_failure(error)
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def write_state_file(directory: Path, *, step: int, group: dict, scheduler: dict, world: int) -> None:
    """state.json: the optimizer step count, the hyperparameters of its parameter group, the LR
    schedule's state and the world size it was saved at."""
    hyperparameters = {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"}
    schedule = {k: v for k, v in scheduler.items() if k != "lr_lambdas"}
    record = {
        "format": FORMAT,
        "step": step,
        "world_size": world,
        "group": hyperparameters,
        "scheduler": schedule,
    }
    (Path(directory) / STATE_FILE).write_text(json.dumps(record, indent=1))


def read_state_file(directory: Path) -> dict:
    """From state.json, what a resume restores besides the moments: the optimizer's step count and
    the LR schedule's position. Hyperparameters (lr, betas, weight decay, the schedule's shape) are
    the current config's, so a resumed run trains with the settings it names."""
    path = Path(directory) / STATE_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise OptimizerStateError(f"{path} cannot be read: {error}") from error
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise OptimizerStateError(f"{path} is not a ppoflow optimizer state (format {FORMAT})")
    schedule = record.get("scheduler")
    if not isinstance(schedule, dict):
        raise OptimizerStateError(f"{path}: scheduler must be an object")
    return {
        "step": _count(record.get("step"), f"{path}: step"),
        "schedule_steps": _count(schedule.get("last_epoch"), f"{path}: scheduler.last_epoch"),
    }


def _count(value, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**53:
        raise OptimizerStateError(f"{where} must be a count, got {str(value)[:40]}")
    return value


# --- one process or FSDP2 (torch's optimizer state dict, sharded as the parameters are) ----------


def save_torch_optimizer(
    directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler
) -> None:
    """The AdamW state of a plain or FSDP2 model; a collective when the model is sharded."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    step = step_count(optimizer.state.values())
    if step > 0:  # (asking for the state dict of an optimizer that never stepped would create one)
        states = _states_by_name(model, optimizer) if not distributed else None
        if states is None:
            states = get_optimizer_state_dict(model, optimizer)["state"]
        moments = {f"{n}.{k}": v for n, s in states.items() for k, v in s.items() if k in MOMENTS}
        save_moments(directory, moments, distributed=distributed)
    if not distributed or dist.get_rank() == 0:
        write_state_file(
            directory,
            step=step,
            group=optimizer.param_groups[0],
            scheduler=scheduler.state_dict(),
            world=dist.get_world_size() if distributed else 1,
        )


WRAPPER_NAMES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""Modules that torch.distributed.checkpoint leaves out of a parameter's name (torch.compile's,
activation checkpointing's and FSDP1's wrappers)."""


def _states_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict] | None:
    """In one process, each stepped parameter's optimizer state by its name in `named_parameters`:
    what get_optimizer_state_dict returns there (the same names and tensors; a tied weight under its
    first name), without its checks, which took 1.6 ms of each save of the tiny model. None when a
    name goes through a wrapper that DCP names differently."""
    states = {}
    for name, parameter in model.named_parameters():
        if any(part in WRAPPER_NAMES for part in name.split(".")):
            return None
        if parameter in optimizer.state:
            states[name] = optimizer.state[parameter]
    return states


def load_torch_optimizer(
    directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler
) -> None:
    """Restore a state saved at any world size into a plain or FSDP2 model's optimizer (each rank
    reads the pieces of its own shard)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    record = read_state_file(directory)
    present = saved_moments(directory, record)
    if record["step"] > 0:
        state = get_optimizer_state_dict(model, optimizer)  # creates the state (a step at lr 0)
        targets = {
            f"{name}.{k}": v
            for name, s in state["state"].items()
            for k, v in s.items()
            if k in MOMENTS and f"{name}.{k}" in present
        }
        check_names(directory, present, targets)
        load_moments(directory, targets)
        for name, s in state["state"].items():
            s["step"] = torch.tensor(float(record["step"]))
            for k in MOMENTS:
                if f"{name}.{k}" in targets:
                    s[k] = targets[f"{name}.{k}"]
        set_optimizer_state_dict(model, optimizer, state)
    restore_schedule(optimizer, scheduler, record)


def step_count(states) -> int:
    """The optimizer's step count: that of the first parameter state holding one (0 before any)."""
    for state in states:
        if "step" in state:
            return int(state["step"])
    return 0


def check_names(directory: Path, present: set[str], targets: dict) -> None:
    """Every saved moment must belong to a parameter of this model."""
    strangers = sorted(present - set(targets))
    if strangers:
        raise OptimizerStateError(
            f"optimizer state in {directory} does not match the model: no parameter for {strangers[0]!r}"
        )


def restore_schedule(optimizer: torch.optim.Optimizer, scheduler, record: dict) -> None:
    """Put the LR schedule where it was after `schedule_steps` steps: each group's lr is its base lr
    (from the config) times the schedule's factor there, as LambdaLR computes it on each step."""
    steps = record["schedule_steps"]
    scheduler.last_epoch, scheduler._step_count = steps, steps + 1
    lrs = [
        base * factor(steps) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs


def saved_moments(directory: Path, record: dict) -> set[str]:
    """The moment names saved in `directory`; a state that has stepped must have some."""
    present = saved_names(directory)
    if record["step"] > 0 and not present:
        raise OptimizerStateError(f"optimizer state in {directory} has a step count but no moments")
    return present
