"""An AdamW state of DeepSpeed ZeRO (stages 1–3) in the files of optimizer_state.py, so that a state
saved by ZeRO loads at any world size, into ZeRO, FSDP2 or one process, and back: moments are gathered
one parameter at a time and written by the rank that owns it; loading reads whole moments a batch of
parameters at a time and keeps each rank's partition.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from ppoflow.tasks.storage.optimizer_state import (
    MOMENTS,
    check_names,
    load_moments,
    read_state_file,
    restore_schedule,
    save_moments,
    saved_moments,
    step_count,
    write_state_file,
)

LOAD_BATCH_BYTES = 256 * 2**20
"""DeepSpeed loads whole moments a batch of parameters at a time (bounded memory on every rank)."""


def save_deepspeed_optimizer(directory: Path, engine, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Every rank gathers one parameter's moments at a time (DeepSpeed's safe_get_full_optimizer_state,
    a collective) and keeps those of the parameters it owns (`owners`), so each rank writes about an
    equal part and none holds the whole state."""
    from deepspeed.utils import safe_get_full_optimizer_state

    rank, world = dist.get_rank(), dist.get_world_size()
    step = step_count(optimizer.state.values())
    if step > 0:
        params = _trainable(engine.module)
        owner = owners([getattr(p, "ds_numel", p.numel()) for _, p in params], world)
        moments = {}
        for (name, param), keeper in zip(params, owner, strict=True):
            for key in MOMENTS:
                value = safe_get_full_optimizer_state(param, key)
                if value is not None and keeper == rank:
                    moments[f"{name}.{key}"] = value.detach().cpu()
        save_moments(directory, moments, distributed=True)
    if rank == 0:
        write_state_file(
            directory,
            step=step,
            group=optimizer.param_groups[0],
            scheduler=scheduler.state_dict(),
            world=world,
        )


def owners(sizes: list[int], world: int) -> list[int]:
    """The rank that writes each parameter: in order, the one with the fewest elements so far."""
    loads, ranks = [0] * world, []
    for size in sizes:
        rank = loads.index(min(loads))
        ranks.append(rank)
        loads[rank] += size
    return ranks


def load_deepspeed_optimizer(directory: Path, engine, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Restore a state saved at any world size into a ZeRO optimizer. Its state exists only after a
    first step, so one step with zero gradients at lr 0 creates it (no parameter moves); then each
    rank reads the whole moments of a batch of parameters and keeps its partition."""
    from deepspeed.utils import safe_set_full_optimizer_state

    record = read_state_file(directory)
    present = saved_moments(directory, record)
    if record["step"] > 0:
        _zero_step(engine, optimizer)
        params = dict(_trainable(engine.module))
        check_names(directory, present, {f"{n}.{k}": None for n in params for k in MOMENTS})
        for batch in _batches(params, present):
            load_moments(directory, batch)
            for key, value in batch.items():
                name, moment = key.rsplit(".", 1)
                param = params[name]
                if hasattr(param, "ds_id"):
                    _set_zero3_state(param, value, moment)
                else:
                    safe_set_full_optimizer_state(param, value, moment)
        for state in optimizer.state.values():
            if "step" in state:
                step = record["step"]
                state["step"] = torch.tensor(float(step)) if torch.is_tensor(state["step"]) else step
    restore_schedule(optimizer, scheduler, record)


def _trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def _batches(params: dict[str, torch.nn.Parameter], present: set[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Whole-size, empty targets for the saved moments, LOAD_BATCH_BYTES at a time."""
    batch, size = {}, 0
    for name, param in params.items():
        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3 keeps only a partition
        for key in MOMENTS:
            if f"{name}.{key}" in present:
                batch[f"{name}.{key}"] = torch.zeros(shape, dtype=torch.float32)
                size += 4 * batch[f"{name}.{key}"].numel()
        if size >= LOAD_BATCH_BYTES:
            yield batch
            batch, size = {}, 0
    if batch:
        yield batch


def _set_zero3_state(param, value: torch.Tensor, key: str) -> None:
    """This rank's partition of a ZeRO-3 parameter's optimizer state `key` from its whole value.
    (DeepSpeed's safe_set_full_optimizer_state fails on a parameter smaller than the world size,
    whose last partitions are padding.)"""
    optimizer = param._z3_optimizer
    partition, _ = optimizer._get_fp32_opt_state_partition(
        param, release_swap_buffers=False, optim_state_key=key
    )
    rank = optimizer._get_param_partition_rank(param)
    size = partition.numel()
    padded = torch.zeros(size * (rank + 1), dtype=partition.dtype)
    flat = value.flatten()[: padded.numel()]
    padded[: flat.numel()] = flat
    partition.data.copy_(padded[size * rank :].to(partition.device))


def _zero_step(engine, optimizer: torch.optim.Optimizer) -> None:
    """One DeepSpeed optimizer step on zero gradients at lr 0 (every rank at once)."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    ids = torch.zeros((1, 1), dtype=torch.long, device=engine.device)
    loss = engine(input_ids=ids).logits.sum() * 0.0
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(loss, scale_wrt_gas=False)
    engine.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
