"""Advantage estimators: verl 0.9.1's ADV_ESTIMATOR_REGISTRY (`trainer/ppo/core_algos.py`), one
registry entry each: a function of the step's tensors (`AdvantageInputs`) and its own settings type.
Per-token rewards in, (advantages, returns) out, both 0 at masked positions (verl leaves whatever its
arithmetic gives there; nothing reads them). Each computes in the dtype and order of operations of
verl's function, so results agree to rounding; the one departure: a group whose scores are all equal
gives every estimator that centres by its group exactly 0 (`advantage_inputs.group_stats`).

The estimators are in group_advantages.py (one score per response, compared within its group) and
token_advantages.py (along each response's tokens). Formulas: docs/ALGORITHMS.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .advantage_inputs import (
    AdvantageInputs,
    DiscountSettings,
    GAESettings,
    GDPOSettings,
    GRPOSettings,
    NoSettings,
    TokenBaselineSettings,
    need,
)
from .group_advantages import (
    gdpo,
    gpg,
    grpo,
    grpo_passk,
    grpo_vectorized,
    opo,
    reinforce_plus_plus_baseline,
    rloo,
    rloo_vectorized,
)
from .names import AdvEstimator
from .token_advantages import (
    gae,
    optimal_token_baseline,
    reinforce_plus_plus,
    remax,
    tir_optimal_token_baseline,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageInputs",
    "AdvantageSpec",
    "DiscountSettings",
    "GAESettings",
    "GDPOSettings",
    "GRPOSettings",
    "NoSettings",
    "TokenBaselineSettings",
    "compute_advantages",
    "group_score_spread_zero_fraction",
]


Estimator = Callable[[AdvantageInputs, Any], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class AdvantageEstimator:
    """One registry entry: the estimator, its settings type, and the inputs it reads beside the
    token-level rewards and the mask."""

    compute: Estimator
    settings: type
    needs: frozenset[str] = frozenset()


_GROUP = frozenset({"group_id"})
_OTB = frozenset({"group_id", "old_log_probs", "sum_pi_squared"})

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": AdvantageEstimator(gae, GAESettings, frozenset({"values"})),
    "grpo": AdvantageEstimator(grpo, GRPOSettings, _GROUP),
    "grpo_vectorized": AdvantageEstimator(grpo_vectorized, NoSettings, _GROUP),
    "gdpo": AdvantageEstimator(gdpo, GDPOSettings, _GROUP | {"reward_components"}),
    "grpo_passk": AdvantageEstimator(grpo_passk, GRPOSettings, _GROUP),
    "rloo": AdvantageEstimator(rloo, NoSettings, _GROUP),
    "rloo_vectorized": AdvantageEstimator(rloo_vectorized, NoSettings, _GROUP),
    "opo": AdvantageEstimator(opo, NoSettings, _GROUP),
    "gpg": AdvantageEstimator(gpg, NoSettings, _GROUP),
    "reinforce_plus_plus": AdvantageEstimator(reinforce_plus_plus, DiscountSettings),
    "reinforce_plus_plus_baseline": AdvantageEstimator(reinforce_plus_plus_baseline, NoSettings, _GROUP),
    "remax": AdvantageEstimator(remax, NoSettings, frozenset({"reward_baselines"})),
    "optimal_token_baseline": AdvantageEstimator(optimal_token_baseline, TokenBaselineSettings, _OTB),
    "tir_optimal_token_baseline": AdvantageEstimator(tir_optimal_token_baseline, TokenBaselineSettings, _OTB),
}
"""verl's ADV_ESTIMATOR_REGISTRY: algorithm.adv_estimator → its estimator. A new estimator is one
function, one settings type (field names are verl's algorithm.* keys: the run plan fills them) and
one entry here."""


@dataclass(frozen=True)
class AdvantageSpec:
    """algorithm.adv_estimator with its settings, built once by the run plan."""

    adv_estimator: AdvEstimator
    settings: Any

    def __post_init__(self) -> None:
        entry = ADVANTAGE_ESTIMATORS.get(self.adv_estimator)
        if entry is None:
            raise ValueError(
                f"unknown adv_estimator {self.adv_estimator!r}; valid choices: "
                f"{', '.join(ADVANTAGE_ESTIMATORS)}"
            )
        if not isinstance(self.settings, entry.settings):
            raise TypeError(
                f"adv_estimator {self.adv_estimator!r} takes {entry.settings.__name__}, "
                f"got {type(self.settings).__name__}"
            )

    @property
    def needs(self) -> frozenset[str]:
        return ADVANTAGE_ESTIMATORS[self.adv_estimator].needs


@torch.no_grad()
def compute_advantages(spec: AdvantageSpec, inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Run `spec`'s estimator without gradient. Returns advantages (N, T) and returns (N, T), both 0
    at masked positions."""
    entry = ADVANTAGE_ESTIMATORS[spec.adv_estimator]
    for name in sorted(entry.needs):
        need(getattr(inputs, name), f"{name} (adv_estimator {spec.adv_estimator!r})")
    advantages, returns = entry.compute(inputs, spec.settings)
    valid = inputs.response_mask != 0
    return torch.where(valid, advantages, 0.0), torch.where(valid, returns, 0.0)


def group_score_spread_zero_fraction(scores: Tensor, group_id: Tensor) -> float:
    """Share of groups whose scores are all equal (max == min); such a group gives GRPO/RLOO no signal.

    scores: (N,) one score per response. group_id: (N,) integer. A group of one counts as all-equal.
    Returns a python float in [0, 1]; 0.0 for an empty batch.
    """
    if scores.numel() == 0:
        return 0.0
    _, inverse = torch.unique(group_id, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1
    high = torch.full((n_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    low = torch.full((n_groups,), float("inf"), dtype=scores.dtype, device=scores.device)
    high = high.scatter_reduce(0, inverse, scores, reduce="amax")
    low = low.scatter_reduce(0, inverse, scores, reduce="amin")
    return (high == low).float().mean().item()
