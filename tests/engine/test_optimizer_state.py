"""The optimizer state on disk: what a resume restores continues training exactly, the files are
tensors and JSON only, and a damaged or planted state is refused with the file named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from ppoflow.engine.optim import build_optimizer
from ppoflow.engine.optimizer_state import (
    OptimizerStateError,
    load_torch_optimizer,
    save_torch_optimizer,
)

from .settings import optim_settings

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
        (lambda r: r["group"].update(lr="0.1"), "group.lr must be a number"),
        (lambda r: r["group"].update(betas=[0.9]), "group.betas must be 2 numbers"),
        (lambda r: r["group"].update(params=[1]), "unknown key 'params'"),
        (lambda r: r["scheduler"].update(lr_lambdas=[{"__class__": 1}]), "unknown key 'lr_lambdas'"),
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
    from ppoflow.engine.optimizer_state import owners

    assert owners([100, 10, 10, 10, 10, 70], 2) == [0, 1, 1, 1, 1, 1]
    assert owners([5, 5, 5], 3) == [0, 1, 2]
    assert owners([], 2) == []


def test_a_state_that_stepped_but_lost_its_moments_is_refused(tmp_path):
    model, _, _ = _trained(tmp_path)
    for tensors in tmp_path.glob("*.safetensors"):
        tensors.unlink()
    with pytest.raises(OptimizerStateError, match="step count but no moments"):
        _restored(tmp_path, model)
