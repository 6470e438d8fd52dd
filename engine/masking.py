"""Masked reductions and loss aggregation: the one place that divides by a count of valid tokens.

A mask holds 0/1 values of any dtype (bool, int or float); a position counts as valid where the mask is
non-zero. Values at masked positions never reach a result, even when they are inf or NaN, because they
are selected away with `torch.where` rather than multiplied by 0.
Conventions follow verl 0.9.1 `verl/utils/torch_functional.py` and `core_algos.agg_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    Returns a scalar when dim is None, else x reduced over dim. (verl divides by the count + 1e-8;
    with the integer and boolean masks its trainer passes, that sum is taken in float32, where the
    1e-8 vanishes: the exact count, as here.)
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
    # verl's factor is n/(n − 1) of its integer mask's count: a float32 value, as here
    bessel = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n)).to(torch.float32)
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


@dataclass(frozen=True)
class Aggregation:
    """How per-token losses become one number (verl's `agg_loss` with its global batch info).

    mode: the loss_agg_mode. The counts are those of the whole mini-batch, summed over data-parallel
    ranks, so that every micro-batch's loss is its share of the mini-batch loss and gradients simply
    add up (no extra 1/num_micro_batches; 1 × 8 and 4 × 2 micro-batches give the same gradient).
    A count left None is taken from the one call's mask, as verl's `agg_loss` does without global
    batch info (standalone use and tests).
    """

    mode: LossAggMode
    tokens: float | None = None
    """Valid tokens of the mini-batch (verl's batch_num_tokens): token-mean's divisor."""
    rows: float | None = None
    """Rows of the mini-batch, rows without a valid token included (verl's global_batch_size: the
    trainer passes ppo_mini_batch_size × rollout.n): the seq-mean modes' divisor. None: this call's
    rows with at least one valid token (verl without global batch info)."""
    loss_scale_factor: float | None = None
    """seq-mean-token-sum-norm's second divisor (verl's actor.loss_scale_factor; ppoflow's training
    passes rollout.response_length when it is unset, the width verl's agent loop pads responses to).
    None: the mask's width T."""

    def __post_init__(self) -> None:
        if self.mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"unknown loss_agg_mode {self.mode!r}; valid choices: {', '.join(LOSS_AGG_MODES)}"
            )
        for name in ("tokens", "rows", "loss_scale_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"Aggregation.{name} must be > 0, got {value}")

    def with_mode(self, mode: LossAggMode) -> Aggregation:
        """The same counts under another mode (SAPO aggregates per sequence whatever is configured)."""
        return replace(self, mode=mode)


def mini_batch_aggregation(
    mask: Tensor, mode: LossAggMode, loss_scale_factor: float | None = None
) -> Aggregation:
    """The Aggregation of a mini-batch of mask (N, T) 0/1, as verl's trainer passes it: its valid
    tokens (at least 1) and its N rows. Compute it once on the whole mini-batch (before it is split
    over ranks and micro-batches) and pass it to every micro-batch's loss."""
    tokens = float(max(int((mask != 0).sum().item()), 1))
    return Aggregation(
        mode, tokens=tokens, rows=float(max(mask.shape[0], 1)), loss_scale_factor=loss_scale_factor
    )


def agg_loss(loss_mat: Tensor, mask: Tensor, agg: Aggregation) -> Tensor:
    """Aggregate a per-token loss to a scalar (verl's `agg_loss`).

    loss_mat: (N, T) per-token loss; masked positions are ignored (may hold anything).
    mask: (N, T) 0/1. With S_i = Σ_t L·M of row i and n_i its valid tokens:
    token-mean: Σ_i S_i / tokens; token-sum: Σ_i S_i; seq-mean-token-sum: Σ_i S_i / rows;
    seq-mean-token-sum-norm: Σ_i S_i / rows / loss_scale_factor; seq-mean-token-mean:
    Σ_{i: n_i > 0} (S_i / n_i) / rows. `agg`'s counts default to this call's (see Aggregation).
    """
    valid = mask != 0
    match agg.mode:  # the sums in verl's order: the token modes over the whole batch, the others by row
        case "token-sum":
            return masked_sum(loss_mat, mask)
        case "token-mean":
            tokens = agg.tokens if agg.tokens is not None else max(int(valid.sum().item()), 1)
            return masked_sum(loss_mat, mask) / tokens
        case "seq-mean-token-sum" | "seq-mean-token-mean" | "seq-mean-token-sum-norm":
            row_sums = masked_sum(loss_mat, mask, dim=-1)
            if agg.mode == "seq-mean-token-mean":
                counts = valid.sum(dim=-1).to(row_sums.dtype)
                row_sums = torch.where(counts > 0, row_sums / counts.clamp(min=1), 0.0)
            rows = agg.rows if agg.rows is not None else max(int(valid.any(dim=-1).sum().item()), 1)
            loss = row_sums.sum() / rows
            if agg.mode == "seq-mean-token-sum-norm":
                loss = loss / (agg.loss_scale_factor or mask.shape[-1])
            return loss
    raise ValueError(f"unknown loss_agg_mode {agg.mode!r}; valid choices: {', '.join(LOSS_AGG_MODES)}")
