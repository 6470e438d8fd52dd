"""The optimizer state on disk: what a resume restores continues training exactly, the files are
tensors and JSON only, and a damaged or planted state is refused with the file named."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors import safe_open

from ppoflow.engine.optim import build_optimizer
from ppoflow.tasks.storage.optimizer_state import (
    OptimizerStateError,
    load_torch_optimizer,
    save_torch_optimizer,
)

from ...engine.settings import optim_settings

SETTINGS = optim_settings(lr=0.05, warmup_steps=2, weight_decay=0.01)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _train(model, optimizer, scheduler, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 5, generator=generator)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def _trained(tmp_path):
    model = _model()
    optimizer, scheduler = build_optimizer(model, SETTINGS)
    _train(model, optimizer, scheduler, steps=3, seed=1)
    save_torch_optimizer(tmp_path, model, optimizer, scheduler)
    return model, optimizer, scheduler


def _restored(tmp_path, model):
    copy = _model()
    copy.load_state_dict(model.state_dict())
    optimizer, scheduler = build_optimizer(copy, SETTINGS)
    load_torch_optimizer(tmp_path, copy, optimizer, scheduler)
    return copy, optimizer, scheduler


def test_a_restored_state_continues_training_bit_for_bit(tmp_path):
    model, optimizer, scheduler = _trained(tmp_path)
    copy, copy_optimizer, copy_scheduler = _restored(tmp_path, model)
    assert copy_scheduler.last_epoch == scheduler.last_epoch == 3
    _train(model, optimizer, scheduler, steps=2, seed=2)
    _train(copy, copy_optimizer, copy_scheduler, steps=2, seed=2)
    for (name, a), b in zip(model.named_parameters(), copy.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert copy_optimizer.state[next(iter(copy.parameters()))]["step"].item() == 5.0


@pytest.mark.parametrize("mixed", [False, True], ids=["one dtype (streamed)", "two dtypes (save_file)"])
def test_one_process_writes_what_torch_distributed_checkpoint_writes_byte_for_byte(tmp_path, mixed):
    """save_moments writes a single process's file itself (without DCP's planning): the same bytes
    as DCP's Hugging Face writer, header sorted as for every rank, so any world size reads it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from ppoflow.tasks.storage.optimizer_state import _sort_header, save_moments

    generator = torch.Generator().manual_seed(3)
    moments = {
        "embed.weight.exp_avg": torch.randn(20, 8, generator=generator),
        "embed.weight.exp_avg_sq": torch.rand(20, 8, generator=generator),
        "head.bias.exp_avg": torch.randn(3, generator=generator),
        "a.scale.exp_avg": torch.randn(1, 2, 3, generator=generator),
        "half.weight.exp_avg": torch.randn(4, 4, generator=generator).to(torch.bfloat16),
    }
    if not mixed:
        moments["half.weight.exp_avg"] = moments["half.weight.exp_avg"].float()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    save_moments(ours, moments, distributed=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (that it saves in a single process)
        dcp.save(moments, storage_writer=HuggingFaceStorageWriter(str(theirs)), no_dist=True)
    for path in theirs.glob("*.safetensors"):
        _sort_header(path)
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for path in theirs.iterdir():
        assert (ours / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("frozen", [False, True], ids=["all trained", "first layer frozen"])
def test_one_process_names_the_moments_as_torch_distributed_checkpoint_does(tied_tiny_model_dir, frozen):
    """A tied embedding, frozen parameters, LoRA adapters: the same names and the same tensors as
    get_optimizer_state_dict, which a save in one process no longer calls."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from ppoflow.engine.lora import LoraSpec, add_adapters
    from ppoflow.engine.models import load_actor
    from ppoflow.tasks.storage.optimizer_state import _states_by_name

    plain = load_actor(tied_tiny_model_dir)
    adapted = add_adapters(
        load_actor(tied_tiny_model_dir),
        LoraSpec(rank=2, alpha=4, target_modules="all-linear", exclude_modules=None, seed=0),
    )
    assert plain.config.tie_word_embeddings
    for model in (plain, adapted):
        if frozen:
            for parameter in next(m for n, m in model.named_modules() if n.endswith("layers.0")).parameters():
                parameter.requires_grad_(False)
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer, _ = build_optimizer(model, SETTINGS)
        model(input_ids=torch.ones(1, 3, dtype=torch.long)).logits.sum().backward()
        optimizer.step()
        ours = _states_by_name(model, optimizer)
        theirs = get_optimizer_state_dict(model, optimizer)["state"]
        assert sorted(ours) == sorted(theirs) and len(ours) == len(trained)
        for name, state in theirs.items():
            assert all(ours[name][k] is v for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")), name
    compiled_name = torch.nn.Module()
    compiled_name._orig_mod = plain  # a torch.compile wrapper: DCP names these itself
    assert _states_by_name(compiled_name, optimizer) is None


MEMORY_PROBE = """
import resource, sys, torch
from pathlib import Path
from ppoflow.tasks.storage.optimizer_state import save_moments
moments = {f"l{i}.weight.{k}": torch.rand(512, 1024) for i in range(32) for k in ("exp_avg", "exp_avg_sq")}
unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
save_moments(Path(sys.argv[1]), moments, distributed=False)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * unit)
"""


def test_a_state_is_written_without_a_copy_of_it_in_memory(tmp_path):
    """The moments are streamed to their file: writing 128 MiB of them raises the process's peak
    resident memory by far less than their size (serialized to bytes first, it rose by twice it)."""
    import subprocess
    import sys

    probe = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(tmp_path)], capture_output=True, text=True, check=True
    )
    size = 32 * 1024 * 1024 * 4
    assert (tmp_path / "model-00001-of-00001.safetensors").stat().st_size > size
    rise = int(probe.stdout.splitlines()[-1])
    assert rise < size / 4, f"peak memory rose by {rise / 2**20:.0f} MiB"


def test_the_files_are_tensors_keyed_by_parameter_and_json(tmp_path):
    model, optimizer, _ = _trained(tmp_path)
    [tensors] = tmp_path.glob("*.safetensors")
    with safe_open(tensors, "pt") as f:
        assert sorted(f.keys()) == sorted(
            f"{n}.{m}" for n, _ in model.named_parameters() for m in ("exp_avg", "exp_avg_sq")
        )
        first = next(iter(model.parameters()))
        assert torch.equal(f.get_tensor("0.weight.exp_avg"), optimizer.state[first]["exp_avg"])
    record = json.loads((tmp_path / "state.json").read_text())
    assert record["step"] == 3 and record["world_size"] == 1
    assert record["group"]["betas"] == list(SETTINGS.betas)
    assert record["scheduler"]["last_epoch"] == 3


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.update(step=-1), "step must be a count"),
        (lambda r: r.update(step=10**400), "step must be a count"),
        (lambda r: r.update(step=3.5), "step must be a count"),
        (lambda r: r["scheduler"].update(last_epoch="3"), "scheduler.last_epoch must be a count"),
        (lambda r: r.update(scheduler=[3]), "scheduler must be an object"),
        (lambda r: r.update(format=99), "not a ppoflow optimizer state"),
    ],
)
def test_a_planted_state_file_is_refused_and_names_it(tmp_path, change, message):
    model, _, _ = _trained(tmp_path)
    record = json.loads((tmp_path / "state.json").read_text())
    change(record)
    (tmp_path / "state.json").write_text(json.dumps(record))
    with pytest.raises(OptimizerStateError, match=message) as error:
        _restored(tmp_path, model)
    assert "state.json" in str(error.value)


def test_hyperparameters_are_the_configs_and_the_schedule_resumes_where_it_was(tmp_path):
    """A resumed run trains with the lr its config names (a NaN or changed lr in state.json is not
    read), at the schedule's saved position: here the second of two warm-up steps, factor 1/2."""
    model, _, _ = _trained(tmp_path)
    record = json.loads((tmp_path / "state.json").read_text())
    record["group"]["lr"] = float("nan")
    record["scheduler"]["last_epoch"] = 1
    (tmp_path / "state.json").write_text(json.dumps(record))
    copy = _model()
    optimizer, scheduler = build_optimizer(copy, optim_settings(lr=0.01, warmup_steps=2))
    load_torch_optimizer(tmp_path, copy, optimizer, scheduler)
    assert optimizer.param_groups[0]["lr"] == 0.01 * 0.5
    assert scheduler.last_epoch == 1 and scheduler.get_last_lr() == [0.005]


def test_pieces_that_do_not_tile_a_moment_are_refused(tmp_path):
    """A planted file whose header puts a piece over another (or outside the tensor) would
    silently overwrite moments: the layout is checked before anything is read."""
    from safetensors.torch import save_file

    model, _, _ = _trained(tmp_path)
    sharding = json.dumps({"0.weight.exp_avg": {"saved_offsets": [3, 0]}})
    planted = {"0.weight.exp_avg": torch.full((2, 5), 1e6)}
    save_file(
        planted, tmp_path / "planted.safetensors", {"DCP_SHARDING_INFO": sharding, "DCP_VERSION": "1.0"}
    )
    with pytest.raises(OptimizerStateError, match="two pieces of 0.weight.exp_avg overlap"):
        _restored(tmp_path, model)
    sharding = json.dumps({"0.weight.exp_avg": {"saved_offsets": [6, 0]}})
    save_file(
        planted, tmp_path / "planted.safetensors", {"DCP_SHARDING_INFO": sharding, "DCP_VERSION": "1.0"}
    )
    with pytest.raises(OptimizerStateError, match="shape"):  # the saved size grows to 8 rows
        _restored(tmp_path, model)


def test_a_moment_that_no_adamw_state_holds_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model, _, _ = _trained(tmp_path)
    [tensors] = tmp_path.glob("*.safetensors")
    saved = load_file(tensors)
    saved["2.bias.exp_avg_sq"] = -saved["2.bias.exp_avg_sq"] - 1
    save_file(saved, tensors)
    with pytest.raises(OptimizerStateError, match="2.bias.exp_avg_sq holds values no AdamW state has"):
        _restored(tmp_path, model)


def test_moments_of_another_model_or_a_damaged_file_are_refused(tmp_path):
    model, _, _ = _trained(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(5, 7))
    optimizer, scheduler = build_optimizer(other, SETTINGS)
    with pytest.raises(OptimizerStateError, match="no parameter for '2.bias.exp_avg'"):
        load_torch_optimizer(tmp_path, other, optimizer, scheduler)
    [tensors] = tmp_path.glob("*.safetensors")
    tensors.write_bytes(tensors.read_bytes()[:200])
    with pytest.raises(OptimizerStateError, match="cannot be read"):
        _restored(tmp_path, model)


def test_zero_ranks_split_the_parameters_by_size():
    from ppoflow.tasks.storage.deepspeed_optimizer_state import owners

    assert owners([100, 10, 10, 10, 10, 70], 2) == [0, 1, 1, 1, 1, 1]
    assert owners([5, 5, 5], 3) == [0, 1, 2]
    assert owners([], 2) == []


def test_a_state_that_stepped_but_lost_its_moments_is_refused(tmp_path):
    model, _, _ = _trained(tmp_path)
    for tensors in tmp_path.glob("*.safetensors"):
        tensors.unlink()
    with pytest.raises(OptimizerStateError, match="step count but no moments"):
        _restored(tmp_path, model)
