"""Per-iteration training metrics: tensors, lists and floats in, `dict[str, float]` out.

Names and definitions follow verl's `verl/trainer/ppo/metric_utils.py` (`compute_data_metrics`,
`compute_timing_metrics`, `compute_throughout_metrics`), `reduce_metrics`,
`verl/utils/debug/metrics.py` (`training/rollout_probs_diff_*`) and the workers' `perf/*memory*`.
Shapes: N responses, T padded response length; `response_mask` (N, T) is 0/1 and every per-token input
is ignored where it is 0 (may hold anything). Token statistics are over the valid tokens of the whole
batch; an empty selection gives max/min NaN. Statistics are computed in float64. Validation metrics
are in validation_metrics.py.
"""

import math
import os
import resource
import sys
from collections import defaultdict

import torch
from torch import Tensor

from .advantages import group_score_spread_zero_fraction
from .losses import explained_variance
from .masking import masked_mean, masked_sum, masked_var


def _sequence_stats(prefix: str, x: Tensor) -> dict[str, float]:
    """{prefix/mean, prefix/max, prefix/min} of a per-row tensor x (N,); NaN for N = 0."""
    x = x.double()
    if x.numel() == 0:
        return {f"{prefix}/{stat}": math.nan for stat in ("mean", "max", "min")}
    return {
        f"{prefix}/mean": x.mean().item(),
        f"{prefix}/max": x.max().item(),
        f"{prefix}/min": x.min().item(),
    }


def _masked_max_min(x: Tensor, mask: Tensor) -> tuple[float, float]:
    """Max and min of x (N, T) over positions where mask (N, T) != 0; (NaN, NaN) when there is none."""
    valid = x[mask != 0]
    if valid.numel() == 0:
        return math.nan, math.nan
    return valid.max().item(), valid.min().item()


def _token_stats(prefix: str, x: Tensor, mask: Tensor) -> dict[str, float]:
    """{prefix/mean, prefix/max, prefix/min} of x (N, T) over valid tokens; mean 0 when there is none."""
    high, low = _masked_max_min(x, mask)
    return {f"{prefix}/mean": masked_mean(x, mask).item(), f"{prefix}/max": high, f"{prefix}/min": low}


def _length_stats(prefix: str, lengths: Tensor, max_length: int) -> dict[str, float]:
    """Sequence stats of lengths (N,) plus prefix/clip_ratio: share of rows with length == max_length."""
    clip = (lengths == max_length).double().mean().item() if lengths.numel() else math.nan
    return _sequence_stats(prefix, lengths) | {f"{prefix}/clip_ratio": clip}


@torch.no_grad()
def compute_data_metrics(
    *,
    scores: Tensor,
    token_level_rewards: Tensor,
    advantages: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    prompt_lengths: Tensor,
    max_prompt_length: int,
    max_response_length: int,
    values: Tensor | None = None,
    response_lengths: Tensor | None = None,
) -> dict[str, float]:
    """verl's `compute_data_metrics`: what the batch looked like before the update.

    scores: (N,) sequence score s_i. token_level_rewards, advantages, returns: (N, T).
    response_mask: (N, T) 0/1. prompt_lengths: (N,) long, prompt tokens per row (padding excluded).
    max_prompt_length, max_response_length: the configured limits (`data.max_*_length`); a row at the
    limit was probably truncated. values: (N, T) critic values, None without a critic.
    Returns critic/score/{mean,max,min} over rows of scores and critic/rewards/{mean,max,min} over rows of
    Σ_t token_level_rewards (valid tokens), both over non-aborted rows only (verl: an aborted row has no
    response token); critic/advantages/*, critic/returns/* and, with values, critic/values/* over valid
    tokens and critic/vf_explained_var (`losses.explained_variance`); response_length/{mean,max,min,
    clip_ratio} of valid tokens per row over all rows (`response_lengths` when given: a
    multi-turn response's length counts its tool tokens, which response_mask leaves out, as
    verl's), response_length_non_aborted/* over non-aborted rows,
    response/aborted_ratio (share of rows without a valid token) and prompt_length/* likewise.
    """
    scores, token_level_rewards = scores.double(), token_level_rewards.double()
    advantages, returns = advantages.double(), returns.double()
    if response_lengths is None:
        response_lengths = (response_mask != 0).sum(dim=-1)
    kept = (response_mask != 0).any(dim=-1)
    metrics = _sequence_stats("critic/score", scores[kept])
    row_rewards = masked_sum(token_level_rewards, response_mask, dim=-1)
    metrics |= _sequence_stats("critic/rewards", row_rewards[kept])
    metrics |= _token_stats("critic/advantages", advantages, response_mask)
    metrics |= _token_stats("critic/returns", returns, response_mask)
    if values is not None:
        values = values.double()
        metrics |= _token_stats("critic/values", values, response_mask)
        metrics["critic/vf_explained_var"] = explained_variance(returns, values, response_mask)
    metrics |= _length_stats("response_length", response_lengths, max_response_length)
    metrics |= _length_stats("response_length_non_aborted", response_lengths[kept], max_response_length)
    metrics["response/aborted_ratio"] = (~kept).double().mean().item() if kept.numel() else math.nan
    metrics |= _length_stats("prompt_length", prompt_lengths, max_prompt_length)
    return metrics


@torch.no_grad()
def compute_group_metrics(scores: Tensor, group_id: Tensor) -> dict[str, float]:
    """How much signal the groups carry for GRPO-style estimators (a prompt's responses form a group).

    scores: (N,) one score per response. group_id: (N,) integer, shared by one prompt's responses.
    Returns critic/score/zero_spread_group_ratio: share of groups whose scores are all equal (they give
    A = 0); critic/score/group_std_mean: mean over groups of the unbiased std of scores, 0 for a group
    of one. Empty when no group has two responses (rollout.n = 1): every group would count as
    zero-spread, which says nothing about the data.
    """
    _, inverse, counts = torch.unique(group_id, return_inverse=True, return_counts=True)
    if scores.numel() == 0 or counts.max() < 2:
        return {}
    scores = scores.double()
    size = counts.to(scores.dtype)
    group_mean = torch.zeros_like(size).index_add_(0, inverse, scores) / size
    sq_dev = torch.zeros_like(size).index_add_(0, inverse, (scores - group_mean[inverse]) ** 2)
    group_std = (sq_dev / (size - 1).clamp(min=1)).sqrt()
    return {
        "critic/score/zero_spread_group_ratio": group_score_spread_zero_fraction(scores, group_id),
        "critic/score/group_std_mean": group_std.mean().item(),
    }


def compute_timing_metrics(timing_s: dict[str, float], num_tokens: dict[str, int]) -> dict[str, float]:
    """verl's `compute_timing_metrics`: wall time per stage, and per token where the count is known.

    timing_s: stage name -> seconds (verl also times the whole "step"). num_tokens: stage name -> tokens
    the stage processed (verl: response tokens for "gen", prompt + response tokens for "ref", "values",
    "adv", "update_critic", "update_actor"; no count for the others).
    Returns timing_s/<stage> for every timed stage and timing_per_token_ms/<stage> = 1000·s / tokens for
    timed stages with tokens > 0.
    """
    metrics = {f"timing_s/{stage}": float(seconds) for stage, seconds in timing_s.items()}
    for stage, seconds in timing_s.items():
        tokens = num_tokens.get(stage, 0)
        if tokens > 0:
            metrics[f"timing_per_token_ms/{stage}"] = 1000.0 * seconds / tokens
    return metrics


def compute_throughput_metrics(*, total_tokens: int, step_seconds: float, n_devices: int) -> dict[str, float]:
    """verl's `compute_throughout_metrics` (sic): tokens per second per device for one step.

    total_tokens: prompt + response tokens of the step (verl: Σ `global_token_num`). step_seconds: wall
    time of the whole step (> 0). n_devices: accelerators used (≥ 1).
    Returns perf/total_num_tokens, perf/time_per_step, perf/throughput = tokens / (seconds · n_devices).
    """
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    return {
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": float(step_seconds),
        "perf/throughput": total_tokens / (step_seconds * n_devices),
    }


@torch.no_grad()
def compute_rollout_probs_diff(
    rollout_log_probs: Tensor, old_log_probs: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """Inference-engine vs trainer mismatch, verl's `calculate_debug_metrics`, on probabilities per token.

    rollout_log_probs: (N, T) from the inference engine. old_log_probs: (N, T) recomputed by the trainer
    with the same weights. response_mask: (N, T) 0/1. Over valid tokens, with d = |exp(rollout) − exp(old)|:
    training/rollout_probs_diff_{max,mean,std} of d, std unbiased (0 with fewer than two tokens, where
    verl's torch.std gives NaN; without a valid token max is NaN and mean, std 0);
    training/rollout_actor_probs_pearson_corr: Pearson correlation of the two probabilities (NaN when either
    is constant or there are fewer than two tokens, as torch.corrcoef); training/rollout_probs_diff_valid: 1.
    Probabilities, not log-probs: rare tokens with large log-prob gaps weigh little (verl's choice).
    """
    rollout_probs, old_probs = rollout_log_probs.double().exp(), old_log_probs.double().exp()
    diff = (rollout_probs - old_probs).abs()
    high, _ = _masked_max_min(diff, response_mask)
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": high,
        "training/rollout_probs_diff_mean": masked_mean(diff, response_mask).item(),
        "training/rollout_probs_diff_std": masked_var(diff, response_mask).sqrt().item(),
        "training/rollout_actor_probs_pearson_corr": _masked_correlation(
            old_probs, rollout_probs, response_mask
        ),
    }


def _masked_correlation(x: Tensor, y: Tensor, mask: Tensor) -> float:
    """Pearson correlation of x and y (N, T) over valid positions; NaN when undefined."""
    if int((mask != 0).sum()) < 2:
        return math.nan
    dx, dy = x - masked_mean(x, mask), y - masked_mean(y, mask)
    covariance = masked_mean(dx * dy, mask)
    scale = (masked_mean(dx**2, mask) * masked_mean(dy**2, mask)).sqrt()
    return (covariance / scale).item() if scale > 0 else math.nan


GIB = 1024**3


def memory_metrics() -> dict[str, float]:
    """verl's perf/max_memory_allocated_gb, perf/max_memory_reserved_gb and perf/cpu_memory_used_gb, GiB.

    When this process has put tensors on a CUDA device: torch.cuda.max_memory_allocated / reserved of the
    current device, the peaks since the process started (verl reads the same after each update). On CPU
    there is no caching allocator to ask: both report the process's peak resident set size (getrusage
    ru_maxrss), the high-water mark a machine must hold for this run. Processes that a stage starts (reward
    workers) are not included. perf/cpu_memory_used_gb: memory in use on the whole host (total − available,
    psutil's `virtual_memory().used`, verl's definition), not only this process's; NaN where unknown.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        allocated = torch.cuda.max_memory_allocated() / GIB
        reserved = torch.cuda.max_memory_reserved() / GIB
    else:
        allocated = reserved = _peak_rss_bytes() / GIB
    return {
        "perf/max_memory_allocated_gb": allocated,
        "perf/max_memory_reserved_gb": reserved,
        "perf/cpu_memory_used_gb": _host_memory_used_bytes() / GIB,
    }


def _peak_rss_bytes() -> float:
    """Peak resident set size of this process (ru_maxrss is in KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)


def _host_memory_used_bytes() -> float:
    """Host memory in use: psutil when installed, else /proc/meminfo's MemTotal − MemAvailable."""
    try:
        import psutil

        return float(psutil.virtual_memory().used)
    except ImportError:
        pass
    if not os.path.exists("/proc/meminfo"):
        return math.nan
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo if ":" in line)
    kib = {key: int(value.split()[0]) for key, value in fields.items() if key in ("MemTotal", "MemAvailable")}
    return float((kib["MemTotal"] - kib["MemAvailable"]) * 1024) if len(kib) == 2 else math.nan


def reduce_update_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """verl's `reduce_metrics` over the rows logged once per optimizer step: the mean of each metric.

    steps: one dict per optimizer (or micro-batch) step. Keys containing '/' are metrics and averaged over
    the rows that hold them; other keys (bookkeeping such as a step counter) are dropped. A NaN in any row
    makes that metric NaN, so a diverged step stays visible.
    """
    collected: dict[str, list[float]] = defaultdict(list)
    for row in steps:
        for key, value in row.items():
            if "/" in key:
                collected[key].append(float(value))
    return {key: sum(values) / len(values) for key, values in collected.items()}
