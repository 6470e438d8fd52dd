"""verl's learning-rate schedules: constant and cosine, both with linear warmup."""

import math

import pytest
import torch

from ppoflow.engine.optim import build_optimizer, lr_multiplier, resolve_warmup_steps

from .settings import optim_settings


def test_constant_with_warmup():
    settings = optim_settings(lr=1.0, warmup_steps=4, total_steps=10)
    assert [lr_multiplier(s, settings) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_decays_to_min_lr_ratio():
    settings = optim_settings(lr=1.0, warmup_steps=2, total_steps=12, warmup_style="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(1, settings) == 0.5
    assert lr_multiplier(2, settings) == pytest.approx(1.0)
    assert lr_multiplier(7, settings) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(12, settings) == pytest.approx(0.1)
    assert lr_multiplier(50, settings) == pytest.approx(0.1)


def test_warmup_steps_resolution_follows_verl():
    assert resolve_warmup_steps(5, 0.5, 100) == 5
    assert resolve_warmup_steps(0, 0.5, 100) == 50  # verl's engines take the ratio at 0 too
    assert resolve_warmup_steps(0, 0.0, 100) == 0
    assert resolve_warmup_steps(-1, 0.1, 100) == 10
    assert resolve_warmup_steps(-1, 0.0, 100) == 0


def test_scheduler_steps_the_optimizer_lr():
    model = torch.nn.Linear(2, 1)
    optimizer, scheduler = build_optimizer(
        model, optim_settings(lr=0.1, warmup_steps=2, total_steps=5, weight_decay=0.0, betas=(0.8, 0.9))
    )
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0)
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
