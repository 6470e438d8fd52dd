"""PPO policy and value losses, and the critic's explained variance.

Each loss returns (scalar loss, metrics) with verl 0.9.1's metric names; `denominator` is passed straight
to `masking.agg_loss` (see there for gradient accumulation). Formulas: docs/ALGORITHMS.md.
"""

import torch
from torch import Tensor

from .masking import LossAggMode, agg_loss, masked_mean, masked_var

LOG_RATIO_CLAMP = 20.0
EXPLAINED_VAR_EPS = 1e-5


def compute_policy_loss(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: LossAggMode,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped PPO surrogate (Schulman et al. 2017, arXiv:1707.06347) with clip-higher and dual clip.

    old_log_probs: (N, T) log π_old, no gradient. log_probs: (N, T) log π_θ, with gradient.
    advantages: (N, T). response_mask: (N, T) 0/1; every input is ignored at masked positions.
    ρ = exp(clamp(log_probs − old_log_probs, −20, 20)); L = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high)),
    and where A < 0 also L = min(L, −A·c) (dual clip, Ye et al. 2020, arXiv:1912.09729; c > 1).
    clip_ratio_high > clip_ratio_low is DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476).
    Returns pg_loss = agg_loss(L, mask, loss_agg_mode, denominator) and python-float metrics, masked means
    over this call's tokens: actor/pg_clipfrac (ε-clip active), actor/ppo_kl (mean of old − new log-prob,
    on the clamped log ratio as verl), actor/pg_clipfrac_lower (dual clip active).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_probs - old_log_probs, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_eps_clip = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(loss_eps_clip, loss_dual_bound), loss_eps_clip)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, denominator)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask).item(),
            "actor/ppo_kl": masked_mean(-log_ratio, response_mask).item(),
            "actor/pg_clipfrac_lower": masked_mean(
                ((loss_eps_clip > loss_dual_bound) & negative).float(), response_mask
            ).item(),
        }
    return pg_loss, metrics


def compute_value_loss(
    vpreds: Tensor,
    values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: LossAggMode,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss: ½·agg(max((v − R)², (clip(v, v_old − ε_v, v_old + ε_v) − R)²)).

    vpreds: (N, T) current critic output v, with gradient. values: (N, T) v_old, before the critic update.
    returns: (N, T) targets R. response_mask: (N, T) 0/1; every input is ignored at masked positions.
    cliprange_value: ε_v. denominator: see `masking.agg_loss`.
    Returns vf_loss and {"critic/vf_clipfrac": masked mean of [clipped error > unclipped error]}.
    """
    vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpreds_clipped - returns) ** 2
    vf_losses = torch.maximum(loss_unclipped, loss_clipped)
    vf_loss = 0.5 * agg_loss(vf_losses, response_mask, loss_agg_mode, denominator)
    with torch.no_grad():
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask).item()
    return vf_loss, {"critic/vf_clipfrac": clipfrac}


@torch.no_grad()
def explained_variance(returns: Tensor, values: Tensor, response_mask: Tensor) -> float:
    """1 − Var(R − V) / (Var(R) + 1e-5) over valid tokens, unbiased variances (`critic/vf_explained_var`).

    returns: (N, T) R. values: (N, T) V. response_mask: (N, T) 0/1; masked positions are ignored.
    Nearly constant returns (all rewards 0, say) make this a huge negative number: a data problem, not a
    critic bug.
    """
    residual_var = masked_var(returns - values, response_mask)
    return (1.0 - residual_var / (masked_var(returns, response_mask) + EXPLAINED_VAR_EPS)).item()
