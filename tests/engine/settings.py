"""Engine settings for the engine's tests: the config's defaults (verl's), built the way a run
builds them, with the fields a test sets. The engine itself has no defaults of its own."""

from __future__ import annotations

import functools
from dataclasses import replace

from ppoflow.conf import load_config
from ppoflow.engine.optim import OptimSettings
from ppoflow.engine.ppo import AdvantageSettings
from ppoflow.engine.update import ActorUpdateSettings, CriticUpdateSettings
from ppoflow.tasks.pipeline.plan import run_settings
from ppoflow.tasks.pipeline.settings import RunSettings

MICRO = [  # verl leaves micro-batch sizes unset; a test sets the one it exercises
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=8",
]


@functools.cache
def _defaults(*overrides: str) -> RunSettings:
    config = load_config(None, [*MICRO, *overrides], base="verl", check_paths=False)
    return run_settings(config, total_steps=1)


def actor_settings(**changes) -> ActorUpdateSettings:
    return replace(_defaults().actor.update, **changes)


def critic_settings(**changes) -> CriticUpdateSettings:
    return replace(_defaults().critic.update, **changes)


def optim_settings(**changes) -> OptimSettings:
    return replace(_defaults().actor.optim, **changes)


def advantage_settings(adv_estimator: str | None = None, **changes) -> AdvantageSettings:
    """The advantage settings of `adv_estimator` (verl's default, gae, when None)."""
    overrides = () if adv_estimator is None else (f"algorithm.adv_estimator={adv_estimator}",)
    return replace(_defaults(*overrides).advantages.estimator, **changes)
