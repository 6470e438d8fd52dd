"""Rollout correction: importance weights and rejection sampling between the policy that sampled
(the rollout engine's log-probs) and the policy being trained, with verl 0.9.1's `rollout_corr/*`
diagnostics (`trainer/ppo/rollout_corr_helper.py`; Liu et al. 2025, "When Speed Kills Stability").

Shapes: N responses, T padded response length. `response_mask` (N, T) is 0/1; log-probs are (N, T)
and ignored at masked positions. log ρ = log π_train − log π_rollout per token. Formulas:
docs/ALGORITHMS.md, "Rollout correction".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .masking import masked_mean, masked_sum
from .names import RolloutISLevel, RolloutRSOption

SAFETY_BOUND = 20.0
"""log-ratios are clamped to ±20 before exponentiation (e^20 ≈ 4.9e8)."""


@dataclass(frozen=True)
class ImportanceSampling:
    """rollout_is with its threshold: truncated weights (TIS: w ≤ upper) or, with a lower bound,
    IcePop (w outside [lower, upper] set to 0)."""

    level: RolloutISLevel
    upper: float
    lower: float | None = None
    batch_normalize: bool = False
    """rollout_is_batch_normalize: divide the weights by their mean (over tokens, or over rows for
    sequence-level weights) after truncation."""


@dataclass(frozen=True)
class RejectionCriterion:
    """One option of rollout_rs with its bounds: a *_k1 option keeps tokens (or sequences) whose
    statistic lies in [log lower, log upper]; the others keep those at or below `upper`."""

    option: RolloutRSOption
    upper: float
    lower: float | None = None


@dataclass(frozen=True)
class RolloutCorrectionSettings:
    """algorithm.rollout_correction as the math reads it, its thresholds parsed."""

    importance_sampling: ImportanceSampling | None
    rejection: tuple[RejectionCriterion, ...] = ()


@dataclass
class Correction:
    """What a correction gives a batch: the weights (N, T) (0 at masked positions; None without
    importance sampling), the response mask with rejected tokens set to 0 (N, T), which criteria
    rejected any token of each row, and the `rollout_corr/*` metrics."""

    weights: Tensor | None
    response_mask: Tensor
    rejected_by: list[list[str]]
    metrics: dict[str, float]
    rejecting: bool = False
    """Rejection sampling was on (its mask and rejected_by say what it kept)."""


@torch.no_grad()
def rollout_correction(
    log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, settings: RolloutCorrectionSettings
) -> Correction:
    """verl's compute_rollout_correction_and_rejection_mask: importance weights of π_train / π_rollout,
    the rejection mask, and the off-policy diagnostics, every metric named `rollout_corr/<name>`.

    log_probs: (N, T) the trainer's log-probs (old log-probs in decoupled mode; the current policy's
    inside the loss in bypass mode). rollout_log_probs: (N, T). response_mask: (N, T) 0/1.
    A batch without a valid token is returned as it is, with no metrics (verl raises).
    """
    valid_rows: list[list[str]] = [[] for _ in range(response_mask.shape[0])]
    if not bool((response_mask != 0).any()):
        return Correction(None, response_mask, valid_rows, {}, rejecting=bool(settings.rejection))
    log_ratio = torch.where(response_mask != 0, log_probs - rollout_log_probs, 0.0)
    metrics: dict[str, float] = {}
    weights = None
    if settings.importance_sampling is not None:
        weights, is_metrics = importance_weights(log_ratio, response_mask, settings.importance_sampling)
        metrics |= is_metrics
    mask, rejected_by = response_mask, valid_rows
    if settings.rejection:
        mask, rejected_by, rs_metrics = rejection_mask(log_ratio, response_mask, settings.rejection)
        metrics |= rs_metrics
    metrics |= off_policy_metrics(log_probs, rollout_log_probs, response_mask)
    named = {f"rollout_corr/{k}": v for k, v in metrics.items()}
    return Correction(weights, mask, rejected_by, named, rejecting=bool(settings.rejection))


def importance_weights(
    log_ratio: Tensor, response_mask: Tensor, spec: ImportanceSampling
) -> tuple[Tensor, dict[str, float]]:
    """Truncated (or IcePop-masked) importance weights (N, T), 0 at masked positions, and verl's
    `rollout_is_*` metrics (before batch normalisation, as verl's).

    token: w_t = exp(clamp(log ρ_t, ±20)); sequence: every token of row i gets
    exp(clamp(Σ_t log ρ_t, ±20)). log_ratio: (N, T), 0 at masked positions.
    """
    if spec.level == "token":
        for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        for_metrics = masked_sum(log_ratio, response_mask, dim=-1).unsqueeze(-1)
        raw = torch.exp(for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * response_mask
    if spec.lower is None:
        weights = raw.clamp(max=spec.upper)
    else:
        inside = (raw >= spec.lower) & (raw <= spec.upper)
        weights = torch.where(inside, raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, for_metrics, response_mask, spec)
    if spec.lower is not None:
        outside = (raw < spec.lower) | (raw > spec.upper)
        metrics["rollout_is_oob_ratio"] = masked_mean(outside.float(), response_mask).item()
    if spec.batch_normalize:
        if spec.level == "token":
            mean = masked_mean(weights, response_mask)
        else:
            per_row = masked_mean(weights, response_mask, dim=-1)
            has_tokens = (response_mask.sum(dim=-1) > 0).to(weights.dtype)
            mean = (per_row * has_tokens).sum() / has_tokens.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _is_metrics(
    weights: Tensor, raw: Tensor, for_metrics: Tensor, response_mask: Tensor, spec: ImportanceSampling
) -> dict[str, float]:
    """verl's compute_is_metrics: the weights' mean, extremes, spread, effective sample size and
    the shares above and below the thresholds (log-space for sequence weights)."""
    lower = 1.0 / spec.upper if spec.lower is None else spec.lower
    valid = response_mask != 0
    metrics: dict[str, float] = {"rollout_is_mean": masked_mean(weights, response_mask).item()}
    if spec.level == "sequence":
        metrics["rollout_is_max"] = torch.exp(for_metrics.max().clamp(max=SAFETY_BOUND)).item()
        metrics["rollout_is_min"] = torch.exp(for_metrics.min()).item()
        log_upper = torch.log(torch.tensor(spec.upper))
        log_lower = torch.log(torch.tensor(lower))
        metrics["rollout_is_ratio_fraction_high"] = (for_metrics > log_upper).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (for_metrics < log_lower).float().mean().item()
    else:
        metrics["rollout_is_ratio_fraction_high"] = masked_mean(
            (raw > spec.upper).float(), response_mask
        ).item()
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).float(), response_mask).item()
        metrics["rollout_is_max"] = weights.masked_fill(~valid, float("-inf")).max().item()
        metrics["rollout_is_min"] = weights.masked_fill(~valid, float("inf")).min().item()
    clamped = weights.clamp(min=0.0, max=spec.upper)
    clamped_mean = masked_mean(clamped, response_mask)
    if response_mask.sum() > 1:
        variance = masked_mean(clamped.square(), response_mask) - clamped_mean.square()
        metrics["rollout_is_std"] = torch.sqrt(variance.clamp(min=0.0)).item()
    else:
        metrics["rollout_is_std"] = 0.0
    normalised = clamped / (clamped_mean + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalised.square(), response_mask).item()
    per_row = masked_mean(weights, response_mask, dim=-1)
    metrics["rollout_is_seq_mean"] = per_row.mean().item()
    metrics["rollout_is_seq_std"] = per_row.std().item() if per_row.numel() > 1 else 0.0
    metrics["rollout_is_seq_max"] = per_row.max().item()
    metrics["rollout_is_seq_min"] = per_row.min().item()
    metrics["rollout_is_seq_max_deviation"] = (per_row - 1.0).abs().max().item()
    raw_per_row = masked_mean(raw, response_mask, dim=-1)
    metrics["rollout_is_seq_fraction_high"] = (raw_per_row > spec.upper).float().mean().item()
    metrics["rollout_is_seq_fraction_low"] = (raw_per_row < lower).float().mean().item()
    return metrics


def _token_statistic(option: str, log_ratio: Tensor) -> Tensor:
    """k1 = −log ρ, k2 = ½ (log ρ)², k3 = ρ − 1 − log ρ per token (log ρ clamped to ±20)."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    match option[-2:]:
        case "k1":
            return -safe
        case "k2":
            return 0.5 * safe**2
        case _:
            return torch.exp(safe) - 1.0 - safe


def _sequence_statistic(option: str, token_stat: Tensor, response_mask: Tensor) -> Tensor:
    """The per-row statistic of a seq_* option: sum, mean (over valid tokens) or max (0 for a row
    without a valid token)."""
    if option.startswith("seq_sum"):
        return masked_sum(token_stat, response_mask, dim=-1)
    if option.startswith("seq_mean"):
        return masked_mean(token_stat, response_mask, dim=-1)
    masked = token_stat.masked_fill(response_mask == 0, float("-inf"))
    high = masked.max(dim=-1).values
    return torch.where(high == float("-inf"), torch.zeros_like(high), high)


def _keeps(criterion: RejectionCriterion, statistic: Tensor) -> Tensor:
    if criterion.option.endswith("k1"):
        assert criterion.lower is not None, "a *_k1 criterion has a lower bound"
        return (statistic >= math.log(criterion.lower)) & (statistic <= math.log(criterion.upper))
    return statistic <= criterion.upper


def rejection_mask(
    log_ratio: Tensor, response_mask: Tensor, criteria: tuple[RejectionCriterion, ...]
) -> tuple[Tensor, list[list[str]], dict[str, float]]:
    """verl's compute_rollout_rejection_mask: a token is kept when every criterion keeps it (a
    sequence criterion keeps or rejects all of its row). Returns the response mask with rejected
    tokens set to 0 (N, T), for each row the criteria that rejected any of its valid tokens, and
    the `rollout_rs_*` metrics. log_ratio: (N, T), 0 at masked positions."""
    valid = response_mask != 0
    has_tokens = response_mask.sum(dim=-1) > 0
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}
    rejected_by: list[list[str]] = [[] for _ in range(response_mask.shape[0])]
    for criterion in criteria:
        option = criterion.option
        token_stat = _token_statistic(option, log_ratio)
        if option.startswith("token"):
            row_stat = None
            keep = _keeps(criterion, token_stat)
            per_token = token_stat
        else:
            row_stat = _sequence_statistic(option, token_stat, response_mask)
            keep = _keeps(criterion, row_stat).unsqueeze(-1).expand_as(valid)
            per_token = row_stat.unsqueeze(-1).expand_as(response_mask)
        k1 = option.endswith("k1")
        metrics |= _rs_metrics(
            option,
            per_token,
            response_mask,
            has_tokens,
            row_stat,
            upper=math.log(criterion.upper) if k1 else criterion.upper,
            lower=math.log(criterion.lower) if k1 and criterion.lower is not None else 0.0,
            two_sided=k1,
        )
        keep_float = keep.to(log_ratio.dtype)
        combined = combined * keep_float
        row_kept = (~(~keep & valid)).all(dim=-1)
        for row in torch.nonzero(~row_kept).flatten().tolist():
            rejected_by[row].append(option)
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1 - keep_float, response_mask).item()
        counted = has_tokens.float()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            (((1.0 - row_kept.to(log_ratio.dtype)) * counted).sum() / counted.sum()).item()
            if counted.sum() > 0
            else 0.0
        )
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - combined, response_mask).item()
    kept = (combined > 0.5) & valid
    metrics["rollout_rs_seq_masked_fraction"] = (~kept & valid).any(dim=-1).float().mean().item()
    return (response_mask * combined).to(response_mask.dtype), rejected_by, metrics


def _rs_metrics(
    option: str,
    per_token: Tensor,
    response_mask: Tensor,
    has_tokens: Tensor,
    row_stat: Tensor | None,
    *,
    upper: float,
    lower: float,
    two_sided: bool,
) -> dict[str, float]:
    """verl's compute_rs_metrics for one criterion, named rollout_rs_<option>_*."""
    prefix = f"rollout_rs_{option}"
    valid = response_mask != 0
    rows = row_stat if row_stat is not None else masked_mean(per_token, response_mask, dim=-1)
    rows = rows[has_tokens]
    sequence = row_stat is not None and rows.numel() > 0
    m: dict[str, float] = {f"{prefix}_mean": masked_mean(per_token, response_mask).item()}
    if sequence:
        m[f"{prefix}_max"], m[f"{prefix}_min"] = rows.max().item(), rows.min().item()
        m[f"{prefix}_fraction_high"] = (rows > upper).float().mean().item()
        m[f"{prefix}_fraction_low"] = (rows < lower).float().mean().item() if two_sided else 0.0
    else:
        m[f"{prefix}_max"] = per_token.masked_fill(~valid, float("-inf")).max().item()
        m[f"{prefix}_min"] = per_token.masked_fill(~valid, float("inf")).min().item()
        m[f"{prefix}_fraction_high"] = masked_mean((per_token > upper).float(), response_mask).item()
        m[f"{prefix}_fraction_low"] = (
            masked_mean((per_token < lower).float(), response_mask).item() if two_sided else 0.0
        )
    if response_mask.sum() > 1:
        bounded = per_token.clamp(min=lower if two_sided else 0.0, max=upper)
        mean = masked_mean(bounded, response_mask)
        variance = masked_mean(bounded.square(), response_mask) - mean.square()
        m[f"{prefix}_std"] = torch.sqrt(variance.clamp(min=0.0)).item()
    else:
        m[f"{prefix}_std"] = 0.0
    if rows.numel() > 0:
        m[f"{prefix}_seq_mean"] = rows.mean().item()
        m[f"{prefix}_seq_std"] = rows.std().item() if rows.numel() > 1 else 0.0
        m[f"{prefix}_seq_max"], m[f"{prefix}_seq_min"] = rows.max().item(), rows.min().item()
        m[f"{prefix}_seq_max_deviation"] = rows.abs().max().item()
        m[f"{prefix}_seq_fraction_high"] = (rows > upper).float().mean().item()
        if two_sided:
            m[f"{prefix}_seq_fraction_low"] = (rows < lower).float().mean().item()
    else:
        for name in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high"):
            m[f"{prefix}_{name}"] = 0.0
        m[f"{prefix}_seq_fraction_low"] = 0.0
    return m


def off_policy_metrics(
    log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """verl's compute_offpolicy_metrics: how far the rollout policy is from the trainer's.

    training_ppl, rollout_ppl: batch means of each row's exp(−mean log-prob); *_log_ppl their logs'
    means; kl = mean of (log π_rollout − log π_train), k3_kl = mean of ρ − log ρ − 1; log_ppl_diff
    (its mean, |·| mean, max, min) per row; ppl_ratio = mean of exp(log_ppl_diff); chi2_token =
    mean of ρ² − 1; chi2_seq = mean over rows of exp(2·Σ log ρ) − 1 (log-ratios clamped to ±20).
    Without rollout log-probs, the training perplexities only.
    """
    train_mean = masked_mean(log_probs, response_mask, dim=-1)
    training = {
        "training_ppl": torch.exp(-train_mean).mean().item(),
        "training_log_ppl": (-train_mean).mean().item(),
    }
    if rollout_log_probs is None:  # the trainer's perplexity only
        return training
    rollout_mean = masked_mean(rollout_log_probs, response_mask, dim=-1)
    log_ratio = torch.where(response_mask != 0, log_probs - rollout_log_probs, 0.0)
    ppl_diff = rollout_mean - train_mean
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_sum = masked_sum(log_ratio, response_mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return training | {
        "kl": masked_mean(rollout_log_probs - log_probs, response_mask).item(),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item(),
        "rollout_ppl": torch.exp(-rollout_mean).mean().item(),
        "rollout_log_ppl": (-rollout_mean).mean().item(),
        "log_ppl_diff": ppl_diff.mean().item(),
        "log_ppl_abs_diff": ppl_diff.abs().mean().item(),
        "log_ppl_diff_max": ppl_diff.max().item(),
        "log_ppl_diff_min": ppl_diff.min().item(),
        "ppl_ratio": torch.exp(ppl_diff).mean().item(),
        "chi2_token": (masked_mean(torch.exp(safe).square(), response_mask) - 1.0).item(),
        "chi2_seq": (torch.exp(2.0 * seq_sum).mean() - 1.0).item(),
    }
