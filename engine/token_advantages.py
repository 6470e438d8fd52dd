"""The estimators of verl 0.9.1 that work along each response's tokens: GAE, REINFORCE++, ReMax and the
optimal token baselines. Registered in engine/advantages.py; formulas: docs/ALGORITHMS.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .advantage_inputs import (
    AdvantageInputs,
    DiscountSettings,
    GAESettings,
    NoSettings,
    TokenBaselineSettings,
    group_rows,
    need,
    on_tokens,
    whiten,
)


def _reward_to_go(inputs: AdvantageInputs) -> Tensor:
    """G_t = Σ_{k≥t} r_k·M_k over the whole row (verl's flip-cumsum-flip; masked positions get the
    sum of what follows, which only they would read)."""
    rewards = torch.where(inputs.response_mask != 0, inputs.token_level_rewards, 0.0)
    return rewards.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])


def gae(inputs: AdvantageInputs, s: GAESettings) -> tuple[Tensor, Tensor]:
    """GAE (arXiv:1506.02438; verl's compute_gae_advantage_return): backward scan with carries
    V_next = A_next = 0; δ_t = r_t + γV_next − V_t, a_t = δ_t + γλA_next; a masked position passes
    both carries through. returns = A + V; advantages whitened over the batch's valid tokens."""
    rewards, values, mask = inputs.token_level_rewards, need(inputs.values, "values"), inputs.response_mask
    valid = mask != 0
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + s.gamma * next_value - values[:, t]
        adv = delta + s.gamma * s.lam * next_adv
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv, next_adv)
        reversed_adv.append(next_adv)
    raw = torch.stack(reversed_adv[::-1], dim=1)
    return whiten(raw, mask), raw + values


def reinforce_plus_plus(inputs: AdvantageInputs, s: DiscountSettings) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (arXiv:2501.03262; verl's compute_reinforce_plus_plus_outcome_advantage):
    G_t = r_t + γ·G_{t+1} over valid tokens, a masked position carrying the running return through
    unchanged (verl ≥ 0.9.0); advantages = G whitened over the batch's valid tokens."""
    valid = inputs.response_mask != 0
    rewards = inputs.token_level_rewards
    running = torch.zeros_like(rewards[:, 0])
    reversed_returns = []
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + s.gamma * running, running)
        reversed_returns.append(running)
    returns = torch.where(valid, torch.stack(reversed_returns[::-1], dim=1), 0.0)
    return whiten(returns, inputs.response_mask), returns


def remax(inputs: AdvantageInputs, s: NoSettings) -> tuple[Tensor, Tensor]:
    """ReMax (arXiv:2310.10505; verl's compute_remax_outcome_advantage): A_t = G_t − b_i with b_i the
    score of a greedy response to the same prompt; no whitening."""
    returns = _reward_to_go(inputs)
    baselines = need(inputs.reward_baselines, "reward_baselines")
    return returns - on_tokens(baselines.to(returns.dtype), inputs.response_mask), returns


def _path_weights(inputs: AdvantageInputs) -> Tensor:
    """W_t = Σ_{j≤t} w_j·M_j with w_j = 1 − 2π_j + Σπ² (× the squared importance weight)."""
    pi = torch.exp(need(inputs.old_log_probs, "old_log_probs"))
    per_token = 1 - 2 * pi + need(inputs.sum_pi_squared, "sum_pi_squared")
    if inputs.rollout_is_weights is not None:
        per_token = per_token * inputs.rollout_is_weights**2
    return torch.where(inputs.response_mask != 0, per_token, 0.0).cumsum(dim=-1)


def _zero_tail(baselines: Tensor, lengths: Tensor, rows: Tensor) -> None:
    """The longest trajectory of a group, when it alone is longest, gets no baseline past the
    second longest one's length (verl's handle_zero_tail)."""
    ordered = torch.sort(lengths[rows]).values
    longest, second = int(ordered[-1]), int(ordered[-2])
    at_longest = (lengths[rows] == longest).nonzero(as_tuple=True)[0]
    if at_longest.numel() == 1 and longest > second:
        baselines[rows[int(at_longest[0])], second:] = 0.0


def optimal_token_baseline(inputs: AdvantageInputs, s: TokenBaselineSettings) -> tuple[Tensor, Tensor]:
    """Optimal token baseline (verl's compute_optimal_token_baseline_advantage): A_t = G_t − B_t,
    B_t = Σ_g G_t·W_t·M_t / (Σ_g W_t·M_t + 1e-8) over the group's trajectories at position t, W the
    cumulative path variance (`_path_weights`); a group of one has no baseline; the longest
    trajectory's unshared tail has none either."""
    mask = inputs.response_mask
    returns = _reward_to_go(inputs)
    path = _path_weights(inputs)
    lengths = (mask != 0).sum(dim=-1)
    baselines = torch.zeros_like(returns)
    for rows in group_rows(need(inputs.group_id, "group_id")):
        if len(rows) == 1:
            continue
        group_mask = torch.where(mask[rows] != 0, 1.0, 0.0).to(returns.dtype)
        numerator = (returns[rows] * path[rows] * group_mask).sum(dim=0)
        denominator = (path[rows] * group_mask).sum(dim=0) + 1e-8
        baselines[rows] = (numerator / denominator).unsqueeze(0).expand(len(rows), -1)
        if s.handle_zero_tail:
            _zero_tail(baselines, lengths, rows)
    return torch.where(mask != 0, returns - baselines, 0.0), returns


def tir_optimal_token_baseline(inputs: AdvantageInputs, s: TokenBaselineSettings) -> tuple[Tensor, Tensor]:
    """The optimal token baseline over each trajectory's own tokens (verl's
    compute_multi_turn_optimal_token_baseline_advantage): the valid tokens of each row are aligned
    from its first, so position k is the k-th token the policy sampled, whatever tool tokens lie
    between; rows without a valid token are left out of their group."""
    mask = inputs.response_mask
    valid = mask != 0
    returns = _reward_to_go(inputs)
    path = _path_weights(inputs)
    lengths = valid.sum(dim=-1)
    width = int(lengths.max()) if lengths.numel() else 0
    aligned_w = path.new_zeros((len(lengths), width))
    aligned_r = torch.zeros_like(aligned_w)
    for row in range(len(lengths)):
        n = int(lengths[row])
        aligned_w[row, :n], aligned_r[row, :n] = path[row, valid[row]], returns[row, valid[row]]
    baselines = torch.zeros_like(aligned_r)
    group = need(inputs.group_id, "group_id")
    for rows in group_rows(group):
        rows = rows[lengths[rows] > 0]
        if len(rows) < 2:
            continue
        b_star = (aligned_r[rows] * aligned_w[rows]).sum(dim=0) / (aligned_w[rows].sum(dim=0) + 1e-8)
        baselines[rows] = b_star.to(baselines.dtype)
        if s.handle_zero_tail:
            _zero_tail(baselines, lengths, rows)
    advantages = torch.zeros_like(returns)
    for row in range(len(lengths)):
        n = int(lengths[row])
        advantages[row, valid[row]] = (aligned_r[row] - baselines[row])[:n]
    return advantages, returns
