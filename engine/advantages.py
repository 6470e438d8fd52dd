"""Advantage estimators: per-token rewards in, (advantages, returns) out.

Shapes: N responses, T padded response length. `response_mask` (N, T) is 0/1, 1 on response tokens up to
and including EOS. `group_id` (N,) is shared by the responses sampled from one prompt (verl's `uid`).
Conventions follow verl 0.9.1 `trainer/ppo/core_algos.py`; docs/ALGORITHMS.md has the formulas.
"""

from typing import get_args

import torch
from torch import Tensor

from .masking import masked_sum, masked_whiten
from .names import AdvEstimator

ADV_ESTIMATORS: tuple[str, ...] = get_args(AdvEstimator)


def compute_gae(
    token_level_rewards: Tensor, values: Tensor, response_mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015, arXiv:1506.02438), not whitened.

    token_level_rewards: (N, T) r_t. values: (N, T) V(s_t). response_mask: (N, T) 0/1.
    Rewards and values at masked positions are never read: the backward scan carries V_next and A_next
    through them unchanged, so a masked position holds the advantage of the next valid token (0 after EOS).
    Returns advantages_raw (N, T) and returns = advantages_raw + values (N, T), both unmasked as in verl;
    `compute_advantages` whitens and zeroes masked positions.
    """
    valid = response_mask != 0
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv, next_adv)
        reversed_adv.append(next_adv)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return advantages, advantages + values


def _group_stats(scores: Tensor, group_id: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row mean, unbiased std and size of the row's group, each (N,).

    scores: (N,) one score per response. group_id: (N,) integer ids. A group of one has mean 0 and
    std 1 (verl's convention, so GRPO and RLOO leave a lone response's score as its advantage). A group
    of several equal scores has exactly that score as its mean and std 0, so every group estimator
    gives it advantage 0: its rounded mean (in float32, 64 × 0.7 sums to 44.800003) divided by
    std + 1e-6 would otherwise push the policy in an arbitrary direction (departure from verl 0.9.1,
    docs/ALGORITHMS.md). The sums are accumulated in float64 (float32 sums of many scores drift).
    """
    _, inverse, counts = torch.unique(group_id, return_inverse=True, return_counts=True)
    wide = scores.to(torch.float64) if scores.device.type != "mps" else scores
    size = counts.to(wide.dtype)
    mean = torch.zeros_like(size).index_add_(0, inverse, wide) / size
    sq_dev = torch.zeros_like(size).index_add_(0, inverse, (wide - mean[inverse]) ** 2)
    std = (sq_dev / (size - 1).clamp(min=1)).sqrt()
    high = torch.full_like(size, float("-inf")).scatter_reduce(0, inverse, wide, reduce="amax")
    low = torch.full_like(size, float("inf")).scatter_reduce(0, inverse, wide, reduce="amin")
    equal = (high == low) & (counts > 1)
    mean = torch.where(equal, high, mean).to(scores.dtype)
    std = torch.where(equal, 0.0, std).to(scores.dtype)
    alone = counts == 1
    mean = torch.where(alone, 0.0, mean)
    std = torch.where(alone, 1.0, std)
    return mean[inverse], std[inverse], counts.to(scores.dtype)[inverse]


def _on_tokens(per_row: Tensor, response_mask: Tensor) -> Tensor:
    """Broadcast a per-row value (N,) to every valid token of (N, T); 0 at masked positions."""
    return torch.where(response_mask != 0, per_row[:, None], 0.0)


def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_id: Tensor,
    *,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024, arXiv:2402.03300): A_i = (s_i − mean_g) / (std_g + ε), s_i = Σ_t r_{i,t}.

    token_level_rewards: (N, T), summed over valid tokens only. response_mask: (N, T) 0/1.
    group_id: (N,) integer. std_g is the unbiased std; a group of one has mean 0, std 1.
    norm_adv_by_std=False is Dr.GRPO (Liu et al. 2025, arXiv:2503.20783): A_i = s_i − mean_g.
    Returns advantages and returns, both (N, T) holding A_i on valid tokens and 0 at masked positions.
    """
    scores = masked_sum(token_level_rewards, response_mask, dim=-1)
    mean, std, _ = _group_stats(scores, group_id)
    advantage = (scores - mean) / (std + epsilon) if norm_adv_by_std else scores - mean
    advantages = _on_tokens(advantage, response_mask)
    return advantages, advantages


def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, group_id: Tensor
) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740): A_i = n/(n−1)·(s_i − mean_g), s_i = Σ_t r_{i,t}.

    That is s_i minus the mean of the other n − 1 scores of its group; a group of one gives A_i = s_i.
    token_level_rewards: (N, T), summed over valid tokens only. response_mask: (N, T) 0/1.
    group_id: (N,) integer. Returns advantages and returns, both (N, T): A_i on valid tokens, 0 masked.
    """
    scores = masked_sum(token_level_rewards, response_mask, dim=-1)
    mean, _, size = _group_stats(scores, group_id)
    scale = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.ones_like(size))
    advantages = _on_tokens(scale * (scores - mean), response_mask)
    return advantages, advantages


def compute_reinforce_plus_plus_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, *, gamma: float
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): G_t = r_t + γ·G_{t+1}, advantages = whiten(G).

    token_level_rewards: (N, T). response_mask: (N, T) 0/1. The backward scan runs over valid tokens
    only: a masked position (padding after EOS, or a span inside the response that the policy did not
    generate) neither adds its reward nor discounts, and carries the running return through unchanged
    (verl ≥ 0.9.0), so a reward after a masked span still reaches the tokens before it.
    Returns advantages (N, T): G whitened over valid tokens, and returns (N, T): G; both 0 where masked.
    """
    valid = response_mask != 0
    running = torch.zeros_like(token_level_rewards[:, 0])
    reversed_returns = []
    for t in reversed(range(token_level_rewards.shape[1])):
        running = torch.where(valid[:, t], token_level_rewards[:, t] + gamma * running, running)
        reversed_returns.append(running)
    returns = torch.stack(reversed_returns[::-1], dim=1)
    advantages = torch.where(valid, masked_whiten(returns, response_mask), 0.0)
    return advantages, torch.where(valid, returns, 0.0)


def compute_reinforce_plus_plus_baseline_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, group_id: Tensor
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: s_i − mean_g on every valid token, then whitened over the batch's valid tokens.

    token_level_rewards: (N, T), summed over valid tokens into s_i. response_mask: (N, T) 0/1.
    group_id: (N,) integer; a group of one has mean 0. Returns advantages and returns, both (N, T) and equal
    (as in verl), 0 at masked positions.
    """
    scores = masked_sum(token_level_rewards, response_mask, dim=-1)
    mean, _, _ = _group_stats(scores, group_id)
    centred = _on_tokens(scores - mean, response_mask)
    advantages = torch.where(response_mask != 0, masked_whiten(centred, response_mask), 0.0)
    return advantages, advantages


def compute_remax_advantage(
    token_level_rewards: Tensor, reward_baselines: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): A_t = G_t − b_i, G_t = Σ_{k≥t} r_k over valid tokens.

    token_level_rewards: (N, T); masked positions are ignored. reward_baselines: (N,) b_i, the reward of a
    greedy response to the same prompt. response_mask: (N, T) 0/1.
    Returns advantages (N, T) and returns G (N, T), both 0 at masked positions.
    """
    valid = response_mask != 0
    rewards = torch.where(valid, token_level_rewards, 0.0)
    returns = torch.where(valid, rewards.flip(-1).cumsum(-1).flip(-1), 0.0)
    advantages = returns - _on_tokens(reward_baselines, response_mask)
    return advantages, returns


def _require(value: Tensor | None, name: str, estimator: str) -> Tensor:
    """value, or a ValueError saying that `estimator` needs `name`."""
    if value is None:
        raise ValueError(f"adv_estimator {estimator!r} needs {name}, got None")
    return value


@torch.no_grad()
def compute_advantages(
    estimator: AdvEstimator,
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None = None,
    group_id: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    reward_baselines: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Run one advantage estimator (`algorithm.adv_estimator`) without gradient.

    token_level_rewards: (N, T). response_mask: (N, T) 0/1. values: (N, T), needed by "gae".
    group_id: (N,) integer, needed by "grpo", "rloo" and "reinforce_plus_plus_baseline".
    reward_baselines: (N,), needed by "remax". gamma, lam: GAE / REINFORCE++ discounting.
    "gae" whitens the raw GAE advantages over the batch's valid tokens (verl); returns are not whitened.
    Returns advantages (N, T) and returns (N, T), both 0 at masked positions for every estimator.
    """
    match estimator:
        case "gae":
            critic_values = _require(values, "values", estimator)
            raw, returns = compute_gae(
                token_level_rewards, critic_values, response_mask, gamma=gamma, lam=lam
            )
            advantages = masked_whiten(raw, response_mask)
        case "grpo":
            advantages, returns = compute_grpo_outcome_advantage(
                token_level_rewards,
                response_mask,
                _require(group_id, "group_id", estimator),
                norm_adv_by_std=norm_adv_by_std_in_grpo,
            )
        case "rloo":
            group = _require(group_id, "group_id", estimator)
            advantages, returns = compute_rloo_outcome_advantage(token_level_rewards, response_mask, group)
        case "reinforce_plus_plus":
            advantages, returns = compute_reinforce_plus_plus_advantage(
                token_level_rewards, response_mask, gamma=gamma
            )
        case "reinforce_plus_plus_baseline":
            group = _require(group_id, "group_id", estimator)
            advantages, returns = compute_reinforce_plus_plus_baseline_advantage(
                token_level_rewards, response_mask, group
            )
        case "remax":
            baselines = _require(reward_baselines, "reward_baselines", estimator)
            advantages, returns = compute_remax_advantage(token_level_rewards, baselines, response_mask)
        case _:
            raise ValueError(
                f"unknown adv_estimator {estimator!r}; valid choices: {', '.join(ADV_ESTIMATORS)}"
            )
    valid = response_mask != 0
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
