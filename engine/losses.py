"""The critic's value loss and explained variance (the policy losses are in policy_losses.py).

The loss returns (scalar loss, metrics) with verl 0.9.1's metric names; `agg` is passed straight to
`masking.agg_loss` (see there for gradient accumulation). Formulas: docs/ALGORITHMS.md.
"""

import torch
from torch import Tensor

from .masking import Aggregation, agg_loss, masked_mean, masked_var

EXPLAINED_VAR_EPS = 1e-5


def compute_value_loss(
    vpreds: Tensor,
    values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float,
    agg: Aggregation,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss: ½·agg(max((v − R)², (clip(v, v_old − ε_v, v_old + ε_v) − R)²)).

    vpreds: (N, T) current critic output v, with gradient. values: (N, T) v_old, before the critic update.
    returns: (N, T) targets R. response_mask: (N, T) 0/1; every input is ignored at masked positions.
    cliprange_value: ε_v. agg: the mini-batch's aggregation (`masking.Aggregation`).
    Returns vf_loss and {"critic/vf_clipfrac": masked mean of [clipped error > unclipped error]}.
    """
    vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpreds_clipped - returns) ** 2
    vf_losses = torch.maximum(loss_unclipped, loss_clipped)
    vf_loss = 0.5 * agg_loss(vf_losses, response_mask, agg)
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
