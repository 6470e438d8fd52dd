"""The policy losses of verl 0.9.1's POLICY_LOSS_REGISTRY (`trainer/ppo/core_algos.py`), one registry
entry each: a function of the step's per-token tensors, its own settings type, and the mini-batch's
aggregation. Each returns (scalar loss, metrics) with verl's metric names and the metrics verl's
function reports (some report none: gpg). Formulas: docs/ALGORITHMS.md, "Policy losses".

Shapes: N responses, T padded response length; every tensor of `PolicyTokens` is (N, T) and ignored
at positions where `response_mask` is 0. ρ = π_θ / π_old per token; "log ρ clamped" is
clamp(log π_θ − log π_old, −20, 20).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .masking import Aggregation, agg_loss, masked_mean, masked_sum
from .names import PolicyLossMode
from .policy_loss_inputs import (
    BypassSettings,
    ClipCovSettings,
    ClipRangeSettings,
    ClipSettings,
    DPPOSettings,
    DROSettings,
    GPGSettings,
    KLCovSettings,
    PolicyTokens,
    SAPOSettings,
)
from .rollout_correction import rollout_correction

LOG_RATIO_CLAMP = 20.0


Metrics = dict[str, float]
LossFn = Callable[[PolicyTokens, Any, Aggregation], tuple[Tensor, Metrics]]


def _log_ratio(t: PolicyTokens, clamp: bool = True) -> Tensor:
    d = t.log_probs - t.old_log_probs
    return torch.clamp(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if clamp else d


def _weighted(losses: Tensor, t: PolicyTokens) -> Tensor:
    return losses if t.rollout_is_weights is None else losses * t.rollout_is_weights


def _rate(condition: Tensor, mask: Tensor) -> float:
    """The share of valid tokens where `condition` holds, taken in float32 as verl's `.float()`."""
    return masked_mean(condition.float(), mask).item()


def vanilla_loss(t: PolicyTokens, s: ClipSettings, agg: Aggregation) -> tuple[Tensor, Metrics]:
    """PPO's clipped surrogate (arXiv:1707.06347) with dual clip (arXiv:1912.09729): L = max(−Aρ,
    −A·clip(ρ, 1 − ε_low, 1 + ε_high)), and min(L, −A·c) where A < 0 (verl's
    compute_policy_loss_vanilla)."""
    log_ratio = _log_ratio(t)
    ratio = log_ratio.exp()
    a, mask = t.advantages, t.response_mask
    unclipped = -a * ratio
    clipped = -a * torch.clamp(ratio, 1.0 - s.clip_ratio_low, 1.0 + s.clip_ratio_high)
    eps_clip = torch.maximum(unclipped, clipped)
    dual_bound = -a * s.clip_ratio_c
    losses = torch.where(a < 0, torch.minimum(dual_bound, eps_clip), eps_clip)
    loss = agg_loss(_weighted(losses, t), mask, agg)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": _rate(clipped > unclipped, mask),
            "actor/ppo_kl": masked_mean(-log_ratio, mask).item(),
            "actor/pg_clipfrac_lower": masked_mean((eps_clip > dual_bound) * (a < 0).float(), mask).item(),
        }
    return loss, metrics


def _dppo_loss(t: PolicyTokens, s: DPPOSettings, agg: Aggregation, valid: Tensor) -> tuple[Tensor, Metrics]:
    """What dppo_tv and dppo_kl share: −A·sg(min(ρ, c))·log π_θ on the tokens `valid` keeps."""
    log_ratio = _log_ratio(t)
    ratio = log_ratio.exp()
    truncated = torch.clamp(ratio, max=s.clip_ratio_c).detach()
    keep = valid.detach().float()
    losses = -t.advantages * truncated * t.log_probs * keep
    loss = agg_loss(_weighted(losses, t), t.response_mask, agg)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": masked_mean((1.0 - keep).float(), t.response_mask).item(),
            "actor/ppo_kl": masked_mean(-log_ratio, t.response_mask).item(),
            "actor/pg_clipfrac_lower": masked_mean(
                (ratio > s.clip_ratio_c).float() * keep, t.response_mask
            ).item(),
        }
    return loss, metrics


def dppo_tv_loss(t: PolicyTokens, s: DPPOSettings, agg: Aggregation) -> tuple[Tensor, Metrics]:
    """DPPO-Binary-TV (verl's compute_policy_loss_dppo_tv): a token counts unless its probability
    moved by more than clip_ratio_high (A > 0, up) or clip_ratio_low (A ≤ 0, down)."""
    moved = t.log_probs.exp() - t.old_log_probs.exp()
    valid = torch.where(t.advantages > 0, moved <= s.clip_ratio_high, moved >= -s.clip_ratio_low)
    return _dppo_loss(t, s, agg, valid)


def dppo_kl_loss(t: PolicyTokens, s: DPPOSettings, agg: Aggregation) -> tuple[Tensor, Metrics]:
    """DPPO-Binary-KL (verl's compute_policy_loss_dppo_kl): a token counts unless the binary KL
    p_old·log(p_old/p) + (1 − p_old)·log((1 − p_old + 1e-8)/(1 − p + 1e-8)) exceeds the bound in the
    direction the advantage pushes."""
    prob, old_prob = t.log_probs.exp(), t.old_log_probs.exp()
    binary_kl = old_prob * (t.old_log_probs - t.log_probs) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    up = (binary_kl <= s.clip_ratio_high) | (prob <= old_prob)
    down = (binary_kl <= s.clip_ratio_low) | (prob >= old_prob)
    return _dppo_loss(t, s, agg, torch.where(t.advantages > 0, up, down))


def gspo_loss(t: PolicyTokens, s: ClipRangeSettings, agg: Aggregation) -> tuple[Tensor, Metrics]:
    """GSPO (arXiv:2507.18071; verl's compute_policy_loss_gspo): the sequence ratio s_i =
    exp(mean_t log ρ) (unclamped) on every token, with a token-level gradient: log s_{i,t} =
    sg(log s_i) + log π_θ − sg(log π_θ), clamped at 10; PPO's clip of s_{i,t}."""
    log_ratio = _log_ratio(t, clamp=False)
    lengths = t.response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, t.response_mask, dim=-1) / lengths
    log_seq_ratio = t.log_probs - t.log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.clamp(log_seq_ratio, max=10.0).exp()
    unclipped = -t.advantages * seq_ratio
    clipped = -t.advantages * torch.clamp(seq_ratio, 1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
    loss = agg_loss(_weighted(torch.maximum(unclipped, clipped), t), t.response_mask, agg)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": _rate(clipped > unclipped, t.response_mask),
            "actor/ppo_kl": masked_mean(-log_ratio, t.response_mask).item(),
            "actor/pg_clipfrac_lower": 0.0,
        }
    return loss, metrics


def sapo_loss(t: PolicyTokens, s: SAPOSettings, agg: Aggregation) -> tuple[Tensor, Metrics]:
    """SAPO (arXiv:2511.20347; verl's compute_policy_loss_sapo): −A·f(ρ) with the soft gate
    f(ρ) = sigmoid(τ(ρ − 1))·4/τ, τ = tau_pos where A > 0 else tau_neg; aggregated per sequence
    (seq-mean-token-mean) whatever loss_agg_mode says, as verl's."""
    log_ratio = _log_ratio(t)
    ratio = log_ratio.exp()
    a = t.advantages
    taus = torch.where(
        a > 0,
        torch.as_tensor(s.tau_pos, dtype=a.dtype, device=a.device),
        torch.as_tensor(s.tau_neg, dtype=a.dtype, device=a.device),
    )
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    loss = agg_loss(_weighted(-gates * a, t), t.response_mask, agg.with_mode("seq-mean-token-mean"))
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": 0.0,
            "actor/ppo_kl": masked_mean(-log_ratio, t.response_mask).item(),
            "actor/pg_clipfrac_lower": 0.0,
        }
    return loss, metrics


def gpg_loss(t: PolicyTokens, s: GPGSettings, agg: Aggregation) -> tuple[Tensor, Metrics]:
    """GPG (verl's compute_policy_loss_gpg): −A·log π_θ; reports no metric, as verl's."""
    return agg_loss(_weighted(-t.log_probs * t.advantages, t), t.response_mask, agg), {}


def clip_cov_loss(t: PolicyTokens, s: ClipCovSettings, agg: Aggregation) -> tuple[Tensor, Metrics]:
    """Clip-Cov (verl's compute_policy_loss_clip_cov): PPO's ε-clip (no dual clip, log ρ unclamped);
    among the valid tokens PPO did not clip whose covariance (A − mean A)·(log π_θ − mean log π_θ)
    lies in (clip_cov_lb, clip_cov_ub), max(1, ⌊clip_cov_ratio · tokens⌋) chosen at random lose
    their loss (and gradient). `t.generator` draws the choice."""
    mask, a = t.response_mask, t.advantages
    valid = mask != 0
    log_ratio = _log_ratio(t, clamp=False)
    ratio = log_ratio.exp()
    unclipped = -a * ratio
    clipped = -a * torch.clamp(ratio, 1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
    with torch.no_grad():
        cov = (a - masked_mean(a, mask)) * (t.log_probs - masked_mean(t.log_probs, mask))
        cov = cov.masked_fill(~valid | ((clipped > unclipped) & valid), float("-inf"))
        budget = max(int(s.clip_cov_ratio * mask.sum().item()), 1)
        candidates = torch.nonzero((cov < s.clip_cov_ub) & (cov > s.clip_cov_lb) & valid)
        if len(candidates) > 0:
            order = torch.randperm(len(candidates), generator=t.generator)
            candidates = candidates[order[: min(budget, len(candidates))]]
        keep = torch.ones_like(a)
        keep[candidates[:, 0], candidates[:, 1]] = 0
    loss = agg_loss(_weighted(torch.maximum(unclipped, clipped) * keep, t), mask, agg)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": _rate(keep == 0, mask),
            "actor/ppo_kl": masked_mean(-log_ratio, mask).item(),
        }
    return loss, metrics


def kl_cov_loss(t: PolicyTokens, s: KLCovSettings, agg: Aggregation) -> tuple[Tensor, Metrics]:
    """KL-Cov (verl's compute_policy_loss_kl_cov): −A·ρ (log ρ unclamped), and −A·ρ +
    ppo_kl_coef·|log ρ| on the max(1, ⌊kl_cov_ratio · tokens⌋) valid tokens with the largest
    covariance (A − mean A)·(log π_θ − mean log π_θ) over the call's valid tokens.
    actor/ppo_kl is the mean |log ρ|, as verl's."""
    mask, a = t.response_mask, t.advantages
    log_ratio = _log_ratio(t, clamp=False)
    ratio = log_ratio.exp()
    losses = -a * ratio
    valid = mask != 0
    flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    if len(flat_valid) > 0:
        with torch.no_grad():
            adv, logp = a[valid].detach(), t.log_probs[valid].detach()
            cov = (adv - adv.mean()) * (logp - logp.mean())
            chosen = flat_valid[torch.topk(cov, max(1, int(len(cov) * s.kl_cov_ratio))).indices]
        rows, cols = chosen // a.shape[1], chosen % a.shape[1]
        penalised = losses[rows, cols] + s.ppo_kl_coef * log_ratio[rows, cols].abs()
        losses = losses.index_put((rows, cols), penalised)
    loss = agg_loss(_weighted(losses, t), mask, agg)
    return loss, {"actor/ppo_kl": masked_mean(log_ratio.detach().abs(), mask).item()}


def geo_mean_loss(t: PolicyTokens, s: ClipRangeSettings, agg: Aggregation) -> tuple[Tensor, Metrics]:
    """GMPO (arXiv:2507.20673; verl's compute_policy_loss_geo_mean): per sequence, −Ā·exp(mean_t of
    the sign-aware clipped log ρ), Ā the mean advantage over its tokens; importance weights enter as
    their geometric mean per sequence. The loss is the mean over the mini-batch's rows (`agg.rows`),
    whatever loss_agg_mode says (verl: torch.mean over the call's rows)."""
    mask, a = t.response_mask, t.advantages
    log_ratio = _log_ratio(t, clamp=False)
    sign = torch.sign(a)
    bounded = torch.clamp(log_ratio, -s.clip_ratio_low, s.clip_ratio_high)
    clipped = sign * torch.minimum(sign * log_ratio, sign * bounded)
    lengths = mask.sum(dim=-1).to(a.dtype).clamp(min=1)
    ratio = torch.exp(masked_sum(clipped, mask, dim=-1) / lengths)
    losses = -(masked_sum(a, mask, dim=-1) / lengths) * ratio
    if t.rollout_is_weights is not None:
        log_weights = torch.log(t.rollout_is_weights + 1e-10)
        losses = losses * torch.exp(masked_sum(log_weights, mask, dim=-1) / lengths)
    rows = agg.rows if agg.rows is not None else float(a.shape[0])
    loss = losses.sum() / rows
    with torch.no_grad():
        moved = log_ratio != bounded
        metrics = {
            "actor/pg_clipfrac": masked_mean((moved * (a > 0)).float(), mask).item(),
            "actor/ppo_kl": masked_mean(-log_ratio, mask).item(),
            "actor/pg_clipfrac_lower": masked_mean((moved * (a < 0)).float(), mask).item(),
        }
    return loss, metrics


def dro_loss(t: PolicyTokens, s: DROSettings, agg: Aggregation) -> tuple[Tensor, Metrics]:
    """DRO (verl's compute_policy_loss_dro): −(A·log π_θ − ½·dro_beta·(log ρ)²), log ρ unclamped."""
    log_ratio = _log_ratio(t, clamp=False)
    losses = -(t.log_probs * t.advantages - 0.5 * s.dro_beta * log_ratio.square())
    loss = agg_loss(_weighted(losses, t), t.response_mask, agg)
    return loss, {"actor/ppo_kl": masked_mean(-log_ratio.detach(), t.response_mask).item()}


def cispo_loss(t: PolicyTokens, s: ClipRangeSettings, agg: Aggregation) -> tuple[Tensor, Metrics]:
    """CISPO (arXiv:2506.13585; verl's compute_policy_loss_cispo): −sg(clip(ρ, 1 − ε_low,
    1 + ε_high))·A·log π_θ: every token keeps a gradient, through log π_θ only."""
    log_ratio = _log_ratio(t)
    ratio = log_ratio.exp()
    bounded = torch.clamp(ratio, 1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
    losses = -bounded.detach() * t.advantages * t.log_probs
    loss = agg_loss(_weighted(losses, t), t.response_mask, agg)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": _rate(ratio != bounded, t.response_mask),
            "actor/ppo_kl": masked_mean(-log_ratio, t.response_mask).item(),
            "actor/pg_clipfrac_lower": 0.0,
        }
    return loss, metrics


def reinforce_loss(t: PolicyTokens, agg: Aggregation) -> tuple[Tensor, Metrics]:
    """REINFORCE with importance weights (verl's compute_policy_loss_reinforce): −A·log π_θ·w;
    actor/ppo_kl = mean of log π_rollout − log π_θ (the old log-probs are the rollout's)."""
    losses = -t.advantages * t.log_probs
    loss = agg_loss(_weighted(losses, t), t.response_mask, agg)
    kl = masked_mean(-(t.log_probs - t.old_log_probs).detach(), t.response_mask)
    return loss, {"actor/ppo_kl": kl.item()}


def bypass_loss(t: PolicyTokens, s: BypassSettings, agg: Aggregation) -> tuple[Tensor, Metrics]:
    """bypass_mode (verl's compute_policy_loss_bypass_mode): the old log-probs are the rollout's.
    Importance weights and rejection of π_θ against π_rollout (algorithm.rollout_correction) are
    taken without gradient; reinforce weighs −A·log π_θ by them over the kept tokens, ppo_clip runs
    vanilla's loss over the kept tokens (its ratio already is π_θ / π_rollout: no weights).
    Adds the `rollout_corr/*` metrics of π_θ against π_rollout."""
    with torch.no_grad():
        correction = rollout_correction(t.log_probs, t.old_log_probs, t.response_mask, s.correction)
    kept = PolicyTokens(
        t.old_log_probs,
        t.log_probs,
        t.advantages,
        correction.response_mask,
        correction.weights if s.loss_type == "reinforce" else None,
        t.generator,
    )
    if s.loss_type == "reinforce":
        loss, metrics = reinforce_loss(kept, agg)
    else:
        loss, metrics = vanilla_loss(kept, s.clip, agg)
    return loss, metrics | correction.metrics


@dataclass(frozen=True)
class PolicyLoss:
    """One registry entry: the loss and the type of the settings it takes."""

    compute: LossFn
    settings: type


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "vanilla": PolicyLoss(vanilla_loss, ClipSettings),
    "dppo_tv": PolicyLoss(dppo_tv_loss, DPPOSettings),
    "dppo_kl": PolicyLoss(dppo_kl_loss, DPPOSettings),
    "gspo": PolicyLoss(gspo_loss, ClipRangeSettings),
    "sapo": PolicyLoss(sapo_loss, SAPOSettings),
    "gpg": PolicyLoss(gpg_loss, GPGSettings),
    "clip_cov": PolicyLoss(clip_cov_loss, ClipCovSettings),
    "kl_cov": PolicyLoss(kl_cov_loss, KLCovSettings),
    "geo_mean": PolicyLoss(geo_mean_loss, ClipRangeSettings),
    "dro": PolicyLoss(dro_loss, DROSettings),
    "cispo": PolicyLoss(cispo_loss, ClipRangeSettings),
    "bypass_mode": PolicyLoss(bypass_loss, BypassSettings),
}
"""verl's POLICY_LOSS_REGISTRY: actor.policy_loss.loss_mode → its loss and settings type. A new loss
is one function, one settings type (whose field names are verl's config keys: the run plan fills
them from actor.policy_loss.* and actor.*) and one entry here."""


@dataclass(frozen=True)
class PolicyLossSpec:
    """actor.policy_loss.loss_mode with its settings, built once by the run plan."""

    loss_mode: PolicyLossMode
    settings: Any

    def __post_init__(self) -> None:
        if self.loss_mode not in POLICY_LOSSES:
            raise ValueError(
                f"unknown policy loss_mode {self.loss_mode!r}; valid choices: {', '.join(POLICY_LOSSES)}"
            )
        wanted = POLICY_LOSSES[self.loss_mode].settings
        if not isinstance(self.settings, wanted):
            raise TypeError(
                f"loss_mode {self.loss_mode!r} takes {wanted.__name__}, got {type(self.settings).__name__}"
            )


def compute_policy_loss(
    spec: PolicyLossSpec, tokens: PolicyTokens, agg: Aggregation
) -> tuple[Tensor, Metrics]:
    """The loss of `spec.loss_mode` on `tokens`, aggregated with `agg` (see masking.Aggregation)."""
    return POLICY_LOSSES[spec.loss_mode].compute(tokens, spec.settings, agg)
