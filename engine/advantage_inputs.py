"""What the advantage estimators read and are set with (engine/advantages.py holds the registry), and
the helpers they share: per-row scores, groups and their statistics, broadcasting to tokens.

Shapes: N responses, T padded response length. `response_mask` (N, T) is 0/1, 1 on the tokens the
policy sampled. `group_id` (N,) is shared by the responses to one prompt (verl's `uid`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .masking import masked_whiten


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read; each entry of ADVANTAGE_ESTIMATORS says which it needs."""

    token_level_rewards: Tensor
    """(N, T) r_t: the score at the row's last valid token, minus β·KL with in-reward KL."""
    response_mask: Tensor
    """(N, T) 0/1 (with decoupled rejection sampling, rejected tokens are 0)."""
    group_id: Tensor | None = None
    """(N,) integer."""
    values: Tensor | None = None
    """(N, T) critic values V(s_t) (gae)."""
    reward_baselines: Tensor | None = None
    """(N,) the score of each prompt's greedy response (remax)."""
    old_log_probs: Tensor | None = None
    """(N, T) (the optimal token baselines)."""
    sum_pi_squared: Tensor | None = None
    """(N, T) Σ_v π(v | s_t)² over the vocabulary, from the old-log-prob pass (the optimal token
    baselines)."""
    rollout_is_weights: Tensor | None = None
    """(N, T) decoupled rollout correction's importance weights (the optimal token baselines scale
    their path variance by the squared weight); None without importance sampling."""
    reward_components: Mapping[str, Tensor] | None = None
    """reward component name → (N,) its value per response (gdpo)."""


@dataclass(frozen=True)
class GAESettings:
    gamma: float
    lam: float


@dataclass(frozen=True)
class GRPOSettings:
    """grpo and grpo_passk: false is Dr. GRPO's unscaled advantage."""

    norm_adv_by_std_in_grpo: bool
    epsilon: float = 1e-6


@dataclass(frozen=True)
class GDPOSettings:
    """gdpo (arXiv:2601.05242): each named reward component normalised within its group (always by
    its std: verl's trainer does not pass norm_adv_by_std_in_grpo on), then a weighted sum (equal
    weights when gdpo_reward_weights is None) whitened over the batch."""

    gdpo_reward_keys: tuple[str, ...]
    gdpo_reward_weights: tuple[float, ...] | None
    epsilon: float = 1e-6

    def __post_init__(self) -> None:
        if not self.gdpo_reward_keys:
            raise ValueError("gdpo needs gdpo_reward_keys: the reward components it normalises")
        weights = self.gdpo_reward_weights
        if weights is not None and len(weights) != len(self.gdpo_reward_keys):
            raise ValueError(
                f"gdpo_reward_weights has {len(weights)} entries for {len(self.gdpo_reward_keys)} "
                "gdpo_reward_keys: give one weight per key"
            )


@dataclass(frozen=True)
class TokenBaselineSettings:
    """The optimal token baselines: handle_zero_tail (verl's trainer leaves it at its default, true)
    gives the longest trajectory of a group no baseline past the second longest one's length."""

    handle_zero_tail: bool = True


@dataclass(frozen=True)
class DiscountSettings:
    """reinforce_plus_plus: the discount of its reward-to-go."""

    gamma: float


@dataclass(frozen=True)
class NoSettings:
    """An estimator with nothing to set (rloo, opo, gpg, remax, …)."""


def row_scores(inputs: AdvantageInputs) -> Tensor:
    """s_i = Σ_t r_{i,t} over the whole row, as verl's: token-level rewards are 0 off the response,
    and a score on a token that rejection sampling masked still counts."""
    return inputs.token_level_rewards.sum(dim=-1)


def group_rows(group_id: Tensor) -> list[Tensor]:
    """Row ids of each group, groups in order of first appearance, rows in order (verl's dicts)."""
    rows_of: dict[int, list[int]] = {}
    for row, g in enumerate(group_id.tolist()):
        rows_of.setdefault(g, []).append(row)
    return [torch.tensor(rows, dtype=torch.long) for rows in rows_of.values()]


def all_equal(values: Tensor) -> bool:
    return values.numel() > 1 and bool(values.max() == values.min())


def group_stats(scores: Tensor, group_id: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row mean, unbiased std and size of the row's group, each (N,), as verl's loops compute
    them (torch.mean / torch.std of the group's scores, in their dtype). A group of one has mean 0
    and std 1. A group of several equal scores has exactly that score as its mean and std 0, so
    every estimator that centres by its group gives it 0: its mean rounded (in float32, 64 × 0.7
    sums to 44.800003) and divided by std + 1e-6 would otherwise push the policy in an arbitrary
    direction (departure from verl 0.9.1, docs/ALGORITHMS.md)."""
    mean, std, size = torch.zeros_like(scores), torch.ones_like(scores), torch.ones_like(scores)
    for rows in group_rows(group_id):
        members = scores[rows]
        size[rows] = float(len(rows))
        if len(rows) == 1:
            continue
        if all_equal(members):
            mean[rows], std[rows] = members[0], 0.0
        else:
            mean[rows], std[rows] = torch.mean(members), torch.std(members)
    return mean, std, size


def equal_rows(scores: Tensor, group_id: Tensor) -> Tensor:
    """(N,) bool: the rows of groups of several equal scores."""
    equal = torch.zeros(scores.shape, dtype=torch.bool)
    for rows in group_rows(group_id):
        if all_equal(scores[rows]):
            equal[rows] = True
    return equal


def on_tokens(per_row: Tensor, response_mask: Tensor) -> Tensor:
    """Broadcast a per-row value (N,) to every valid token of (N, T); 0 at masked positions."""
    return torch.where(response_mask != 0, per_row[:, None], torch.zeros((), dtype=per_row.dtype))


def outcome(per_row: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    advantages = on_tokens(per_row, response_mask)
    return advantages, advantages


def whiten(x: Tensor, response_mask: Tensor) -> Tensor:
    """masked_whiten over the batch's valid tokens, 0 at masked positions."""
    return torch.where(response_mask != 0, masked_whiten(x, response_mask), torch.zeros((), dtype=x.dtype))


def need(value: Any, name: str) -> Any:
    """value, or a ValueError saying that the estimator needs `name`."""
    if value is None:
        raise ValueError(f"this advantage estimator needs {name}, got None")
    return value
