"""Masked reductions and loss aggregation: the one place that divides by a count of valid tokens.

A mask holds 0/1 values of any dtype (bool, int or float); a position counts as valid where the mask is
non-zero. Values at masked positions never reach a result, even when they are inf or NaN, because they
are selected away with `torch.where` rather than multiplied by 0.
Conventions follow verl 0.9.1 `verl/utils/torch_functional.py` and `core_algos.agg_loss`.
"""

from typing import get_args

import torch
from torch import Tensor

from .names import LossAggMode

LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)

WHITEN_EPS = 1e-8


def _zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    """x with every position where mask == 0 set to 0 (NaN and inf included)."""
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _count(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None) -> Tensor:
    """Number of valid entries of x (mask broadcast to x's shape), reduced like `masked_sum`."""
    valid = torch.broadcast_to(mask != 0, x.shape).to(x.dtype)
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of x over valid positions.

    x: any shape. mask: broadcastable to x, 0/1; masked entries of x are ignored (may hold anything).
    Returns a scalar when dim is None, else x reduced over dim.
    """
    zeroed = _zero_masked(x, mask)
    return zeroed.sum() if dim is None else zeroed.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of x over valid positions; 0 (not NaN) where there is no valid position.

    x: any shape. mask: broadcastable to x, 0/1; masked entries of x are ignored (may hold anything).
    Returns a scalar when dim is None, else x reduced over dim.
    """
    count = _count(x, mask, dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of x over all valid entries, as a scalar tensor.

    x: any shape. mask: broadcastable to x, 0/1; masked entries of x are ignored.
    unbiased: divide by n − 1 (Bessel, verl's default) instead of n. With fewer than two valid entries the
    unbiased variance is undefined; verl raises there, this returns 0 so that whitening a lone token gives 0.
    """
    mean = masked_mean(x, mask)
    variance = masked_mean((x - mean) ** 2, mask)
    if not unbiased:
        return variance
    n = _count(x, mask, None)
    bessel = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n))
    return variance * bessel


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x − μ) / sqrt(σ² + 1e-8) with μ, σ² the mean and unbiased variance over valid entries of x.

    x: any shape. mask: broadcastable to x, 0/1. The result has x's shape; masked positions are
    transformed too (they hold (x − μ)/σ, not 0): multiply by the mask when storing.
    shift_mean=False adds μ back, keeping the mean and only rescaling (verl `masked_whiten`).
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def agg_denominator(mask: Tensor, mode: LossAggMode) -> float:
    """The count `agg_loss` divides by, for mask (N, T) 0/1, clamped to ≥ 1.

    token-mean: valid tokens. seq-mean-token-sum, seq-mean-token-mean: rows with ≥ 1 valid token.
    seq-mean-token-sum-norm: rows with ≥ 1 valid token × T (the padded length, so extra padding
    columns change it; verl ≥ 0.9.0 leaves fully masked rows out, as for seq-mean-token-sum).
    Under gradient accumulation compute it once on the whole mini-batch mask (summed over data-parallel
    ranks) and pass it to `agg_loss` for every micro-batch.
    """
    valid = mask != 0
    match mode:
        case "token-mean":
            count = valid.sum().item()
        case "seq-mean-token-sum" | "seq-mean-token-mean":
            count = valid.any(dim=-1).sum().item()
        case "seq-mean-token-sum-norm":
            count = valid.any(dim=-1).sum().item() * mask.shape[-1]
        case _:
            raise ValueError(f"unknown loss_agg_mode {mode!r}; valid choices: {', '.join(LOSS_AGG_MODES)}")
    return float(max(count, 1))


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: LossAggMode, denominator: float | None = None) -> Tensor:
    """Aggregate a per-token loss to a scalar: numerator(mode) / denominator.

    loss_mat: (N, T) per-token loss; masked positions are ignored (may hold anything).
    mask: (N, T) 0/1. Numerators: token-mean, seq-mean-token-sum and seq-mean-token-sum-norm: Σ L·M;
    seq-mean-token-mean: Σ over rows of (Σ_t L·M / Σ_t M), rows without a valid token adding 0.
    denominator: `agg_denominator` of the whole mini-batch (summed over data-parallel ranks) when this
    call sees one micro-batch; then the micro-batch losses simply add up (no extra 1/num_micro_batches)
    and 1×8 and 4×2 micro-batches give the same gradient. None: `agg_denominator(mask, mode)`.
    """
    match mode:
        case "token-mean" | "seq-mean-token-sum" | "seq-mean-token-sum-norm":
            numerator = masked_sum(loss_mat, mask)
        case "seq-mean-token-mean":
            numerator = masked_mean(loss_mat, mask, dim=-1).sum()
        case _:
            raise ValueError(f"unknown loss_agg_mode {mode!r}; valid choices: {', '.join(LOSS_AGG_MODES)}")
    if denominator is None:
        denominator = agg_denominator(mask, mode)
    elif denominator <= 0:
        raise ValueError(f"denominator must be > 0, got {denominator}")
    return numerator / denominator
