"""The outcome estimators of verl 0.9.1 that compare a response with the others of its group (GRPO and
its relatives, RLOO, OPO, GPG, REINFORCE++-baseline): one score per response in, the same advantage
on each of its valid tokens out. Registered in engine/advantages.py; formulas: docs/ALGORITHMS.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .advantage_inputs import (
    AdvantageInputs,
    GDPOSettings,
    GRPOSettings,
    NoSettings,
    all_equal,
    equal_rows,
    group_rows,
    group_stats,
    need,
    on_tokens,
    outcome,
    row_scores,
    whiten,
)


def _grpo_of(scores: Tensor, group_id: Tensor, s: GRPOSettings) -> Tensor:
    """(N,) (s_i − mean_g) / (std_g + ε), or s_i − mean_g (Dr. GRPO). A group of one divides by
    1 + ε taken in float32, as verl's (its mean 0 and std 1 are float32 tensors)."""
    mean, std, size = group_stats(scores, group_id)
    if not s.norm_adv_by_std_in_grpo:
        return scores - mean
    alone = float(torch.tensor(1.0) + s.epsilon)
    return (scores - mean) / torch.where(size > 1, std + s.epsilon, alone)


def grpo(inputs: AdvantageInputs, s: GRPOSettings) -> tuple[Tensor, Tensor]:
    """GRPO (arXiv:2402.03300; verl's compute_grpo_outcome_advantage): A_i = (s_i − mean_g) /
    (std_g + ε) on every valid token, or s_i − mean_g without norm_adv_by_std_in_grpo (Dr. GRPO,
    arXiv:2503.20783)."""
    return outcome(_grpo_of(row_scores(inputs), need(inputs.group_id, "group_id"), s), inputs.response_mask)


def grpo_vectorized(inputs: AdvantageInputs, s: NoSettings) -> tuple[Tensor, Tensor]:
    """verl's compute_grpo_vectorized_outcome_advantage: GRPO with the group statistics of verl's
    group_mean_std, always taken in float32: mean = Σs/n, std = √(Σ(s − mean)²/(n − 1)); always
    divided by std + 1e-6 (verl's trainer does not pass norm_adv_by_std_in_grpo on)."""
    scores, group = row_scores(inputs), need(inputs.group_id, "group_id")
    _, index = torch.unique(group, return_inverse=True)
    narrow = scores.to(torch.float32)
    zeros = torch.zeros(int(index.max()) + 1, dtype=torch.float32)
    count = zeros.clone().index_add_(0, index, torch.ones_like(narrow))
    mean = zeros.clone().index_add_(0, index, narrow) / count.clamp_min(1.0)
    centred = narrow - mean[index]
    variance = zeros.clone().index_add_(0, index, centred * centred) / (count - 1.0).clamp_min(1.0)
    single = count <= 1.0
    mean = torch.where(single, 0.0, mean)[index]
    std = torch.where(single, 1.0, torch.sqrt(variance.clamp(min=0.0)))[index]
    equal = equal_rows(scores, group)
    centred_scores = torch.where(equal, 0.0, scores - mean)
    return outcome(centred_scores / (torch.where(equal, 0.0, std) + 1e-6), inputs.response_mask)


def gdpo(inputs: AdvantageInputs, s: GDPOSettings) -> tuple[Tensor, Tensor]:
    """GDPO (arXiv:2601.05242; verl's compute_gdpo_outcome_advantage): GRPO of each reward component
    named in gdpo_reward_keys (as float32, as verl reads them), their weighted sum, whitened over the
    batch's valid tokens."""
    components = need(inputs.reward_components, "reward_components")
    missing = [key for key in s.gdpo_reward_keys if key not in components]
    if missing:
        raise ValueError(
            f"algorithm.gdpo_reward_keys names {', '.join(missing)}, which the reward does not return; "
            f"its components are {', '.join(sorted(components)) or 'none'}"
        )
    group = need(inputs.group_id, "group_id")
    weights = s.gdpo_reward_weights or (1.0,) * len(s.gdpo_reward_keys)
    total: Tensor | None = None
    for key, weight in zip(s.gdpo_reward_keys, weights, strict=True):
        normalised = _grpo_of(components[key].to(torch.float32), group, GRPOSettings(True, s.epsilon))
        part = on_tokens(normalised, inputs.response_mask)
        term = torch.tensor(weight, dtype=torch.float32) * part
        total = term if total is None else total + term
    assert total is not None  # gdpo_reward_keys is not empty
    advantages = whiten(total, inputs.response_mask)
    return advantages, advantages


def grpo_passk(inputs: AdvantageInputs, s: GRPOSettings) -> tuple[Tensor, Tensor]:
    """GRPO pass@k (arXiv:2503.19595; verl's compute_grpo_passk_outcome_advantage): only the best
    response of each group gets an advantage, r_max − r_second (÷ (std_g + ε) with
    norm_adv_by_std_in_grpo); needs at least 2 responses per group."""
    scores = row_scores(inputs)
    advantage = torch.zeros_like(scores)
    for rows in group_rows(need(inputs.group_id, "group_id")):
        if len(rows) < 2:
            raise ValueError(
                f"grpo_passk needs at least 2 responses per prompt, got {len(rows)}: set "
                "actor_rollout_ref.rollout.n ≥ 2"
            )
        members = scores[rows]
        top, top_index = torch.topk(members, 2)
        value = top[0] - top[1]
        if s.norm_adv_by_std_in_grpo:
            value = value / (torch.std(members) + s.epsilon)
        advantage[rows[int(top_index[0])]] = value
    return outcome(advantage, inputs.response_mask)


def rloo(inputs: AdvantageInputs, s: NoSettings) -> tuple[Tensor, Tensor]:
    """RLOO (arXiv:2402.14740; verl's compute_rloo_outcome_advantage): A_i = s_i·n/(n − 1) −
    mean_g·n/(n − 1), s_i minus the mean of the other responses; a group of one keeps s_i."""
    scores = row_scores(inputs)
    mean, _, size = group_stats(scores, need(inputs.group_id, "group_id"))
    several = size > 1
    others = (size - 1).clamp(min=1)
    advantage = torch.where(several, scores * size / others - mean * size / others, scores)
    return outcome(advantage, inputs.response_mask)


def rloo_vectorized(inputs: AdvantageInputs, s: NoSettings) -> tuple[Tensor, Tensor]:
    """verl's compute_rloo_vectorized_outcome_advantage: (n·s_i − Σ_g s) / (n − 1) for groups of
    several, 0 for a group of one (where rloo keeps s_i)."""
    scores, group = row_scores(inputs), need(inputs.group_id, "group_id")
    _, index = torch.unique(group, return_inverse=True)
    count = torch.bincount(index)[index].to(scores.dtype)
    sums = torch.bincount(index, weights=scores)[index]
    advantage = ((count * scores - sums) / (count - 1).clamp_min(1)) * (count > 1)
    advantage = torch.where(equal_rows(scores, group), 0.0, advantage)
    return outcome(advantage, inputs.response_mask)


def opo(inputs: AdvantageInputs, s: NoSettings) -> tuple[Tensor, Tensor]:
    """OPO (arXiv:2505.23585; verl's compute_opo_outcome_advantage): s_i minus the length-weighted
    mean of its group's scores, Σ|y_j|·s_j / Σ|y_j| (|y| its valid tokens); a group of one keeps s_i."""
    scores, mask = row_scores(inputs), inputs.response_mask
    lengths = (mask != 0).sum(dim=-1)
    baseline = torch.zeros_like(scores)
    for rows in group_rows(need(inputs.group_id, "group_id")):
        members = scores[rows]
        if len(rows) == 1:
            continue
        if all_equal(members):
            baseline[rows] = members[0]
        else:
            baseline[rows] = (lengths[rows] * members).sum() / lengths[rows].sum()
    return outcome(scores - baseline, mask)


def gpg(inputs: AdvantageInputs, s: NoSettings) -> tuple[Tensor, Tensor]:
    """GPG (verl's compute_gpg_outcome_advantage): α·(s_i − mean_g), α = N / (rows with a non-zero
    score), the std unused (f_norm 1)."""
    scores = row_scores(inputs)
    alpha = torch.tensor(len(scores)) / torch.count_nonzero(scores).clamp(min=1)
    mean, _, _ = group_stats(scores, need(inputs.group_id, "group_id"))
    return outcome(alpha * (scores - mean) / 1.0, inputs.response_mask)


def reinforce_plus_plus_baseline(inputs: AdvantageInputs, s: NoSettings) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (verl's compute_reinforce_plus_plus_baseline_outcome_advantage): s_i −
    mean_g on every valid token, then whitened over the batch's valid tokens (so an all-equal group
    gets −mean/std of the batch, not 0)."""
    scores = row_scores(inputs)
    mean, _, _ = group_stats(scores, need(inputs.group_id, "group_id"))
    advantages = whiten(on_tokens(scores - mean, inputs.response_mask), inputs.response_mask)
    return advantages, advantages
