"""The algorithm's settings, from the config: the policy loss (`PolicyLossSpec`), the advantage
estimator (`AdvantageSpec`) and rollout correction, each a registry entry's own settings type filled
by name from verl's keys. Part of `run_settings` (plan.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any

from ppoflow.conf import PPOFlowConfig
from ppoflow.conf.schema_algorithm import RolloutCorrectionConfig
from ppoflow.engine.advantages import ADVANTAGE_ESTIMATORS, AdvantageSpec
from ppoflow.engine.policy_losses import (
    POLICY_LOSSES,
    BypassSettings,
    ClipSettings,
    PolicyLossSpec,
)
from ppoflow.engine.rollout_correction import (
    ImportanceSampling,
    RejectionCriterion,
    RolloutCorrectionSettings,
)


def filled(settings_type: type, values: Mapping[str, Any]) -> Any:
    """An instance of the dataclass `settings_type` whose every field is the value of the config key
    of its name in `values` (a field with a default may be absent)."""
    given = {}
    for f in fields(settings_type):
        if f.name in values:
            given[f.name] = values[f.name]
        elif f.default is MISSING and f.default_factory is MISSING:
            raise KeyError(f"{settings_type.__name__}.{f.name} has no config key of that name")
    return settings_type(**given)


def bypass_replaces_the_loss(cfg: PPOFlowConfig) -> bool:
    """Bypass mode with REINFORCE, importance weights or rejection sampling: verl's trainer then
    trains with the bypass_mode loss (as it does with loss_mode=bypass_mode set)."""
    correction = cfg.algorithm.rollout_correction
    chosen = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if chosen == "bypass_mode":
        return True
    return correction.bypass_mode and (correction.loss_type == "reinforce" or correction.corrects)


def policy_loss_spec(cfg: PPOFlowConfig) -> PolicyLossSpec:
    """actor.policy_loss.loss_mode with its settings (actor.policy_loss.* and actor.* by name)."""
    actor = cfg.actor_rollout_ref.actor
    values = {
        **actor.model_dump(),
        **actor.policy_loss.model_dump(),
        "clip_ratio_low": actor.effective_clip_ratio_low,
        "clip_ratio_high": actor.effective_clip_ratio_high,
    }
    if bypass_replaces_the_loss(cfg):
        correction = cfg.algorithm.rollout_correction
        settings = BypassSettings(
            correction.loss_type, filled(ClipSettings, values), rollout_correction_settings(correction)
        )
        return PolicyLossSpec("bypass_mode", settings)
    mode = actor.policy_loss.loss_mode
    return PolicyLossSpec(mode, filled(POLICY_LOSSES[mode].settings, values))


def advantage_spec(cfg: PPOFlowConfig) -> AdvantageSpec:
    """algorithm.adv_estimator with its settings (algorithm.* by name)."""
    algorithm = cfg.algorithm
    weights = algorithm.gdpo_reward_weights
    values = {
        **algorithm.model_dump(),
        "gdpo_reward_keys": tuple(algorithm.gdpo_reward_keys or ()),
        "gdpo_reward_weights": tuple(weights) if weights is not None else None,
    }
    settings_type = ADVANTAGE_ESTIMATORS[algorithm.adv_estimator].settings
    return AdvantageSpec(algorithm.adv_estimator, filled(settings_type, values))


def rollout_correction_settings(section: RolloutCorrectionConfig) -> RolloutCorrectionSettings:
    """algorithm.rollout_correction's importance sampling and rejection criteria, parsed."""
    importance = None
    if section.rollout_is is not None:
        upper, lower = section.is_bounds
        importance = ImportanceSampling(section.rollout_is, upper, lower, section.rollout_is_batch_normalize)
    rejection = tuple(RejectionCriterion(*criterion) for criterion in section.rs_criteria)
    return RolloutCorrectionSettings(importance, rejection)


def decoupled_correction(cfg: PPOFlowConfig) -> RolloutCorrectionSettings | None:
    """The correction the advantages stage takes once per step (decoupled mode: the trainer's old
    log-probs against the rollout's; always at least its rollout_corr/* diagnostics, as verl's
    trainer), or None in bypass mode, where the old log-probs are the rollout's."""
    section = cfg.algorithm.rollout_correction
    return None if section.bypass_mode else rollout_correction_settings(section)
