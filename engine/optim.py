"""AdamW with verl's learning-rate schedules (constant or cosine, both with linear warmup).

The schedule steps once per training iteration (verl's convention), not once per mini-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .names import WarmupStyle


@dataclass(frozen=True)
class OptimSettings:
    """A model's optimizer and LR schedule, in verl's names (`*.optim.*`). Built once per run from
    the config (tasks/pipeline/update_settings.py), which holds every default."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    warmup_steps: int
    """lr_warmup_steps, or lr_warmup_steps_ratio × total_steps when that is negative."""
    total_steps: int
    """The schedule's horizon: the run's training steps (0 when the schedule does not depend on it;
    verl likewise sets optim.total_training_steps to the run's length)."""
    warmup_style: WarmupStyle
    min_lr_ratio: float


def resolve_warmup_steps(lr_warmup_steps: int, lr_warmup_steps_ratio: float, total_steps: int) -> int:
    """verl's rule, as every verl 0.9.1 engine applies it: `lr_warmup_steps` when it is > 0, else
    ratio × total steps (so 0 and the default -1 both take the ratio)."""
    return lr_warmup_steps if lr_warmup_steps > 0 else int(lr_warmup_steps_ratio * total_steps)


def lr_multiplier(step: int, settings: OptimSettings) -> float:
    """Factor applied to the base lr after `step` scheduler steps."""
    if step < settings.warmup_steps:  # verl (and transformers' schedules): 0 on the very first update
        return step / max(1, settings.warmup_steps)
    if settings.warmup_style == "constant":
        return 1.0
    decay_steps = max(1, settings.total_steps - settings.warmup_steps)
    progress = min(1.0, (step - settings.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * cosine


def build_optimizer(
    model: torch.nn.Module, settings: OptimSettings
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, settings))
    return optimizer, scheduler
