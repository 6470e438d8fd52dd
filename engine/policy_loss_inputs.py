"""What the policy losses read and are set with (engine/policy_losses.py holds the losses and their
registry): the step's per-token tensors, and one settings type per loss whose field names are verl's
config keys (actor.policy_loss.* and actor.*), so the run plan fills them by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .names import BypassLossType
from .rollout_correction import RolloutCorrectionSettings


@dataclass(frozen=True)
class PolicyTokens:
    """The per-token inputs of a policy loss, each (N, T)."""

    old_log_probs: Tensor
    """log π_old, no gradient (in bypass mode, the rollout engine's log-probs)."""
    log_probs: Tensor
    """log π_θ, with gradient."""
    advantages: Tensor
    response_mask: Tensor
    """0/1 (any dtype); rejected tokens of decoupled rollout correction are already 0."""
    rollout_is_weights: Tensor | None = None
    """Decoupled rollout correction's importance weights (no gradient; 0 at masked positions), each
    token's loss is multiplied by its weight; None without importance sampling."""
    generator: torch.Generator | None = None
    """clip_cov's random choice of tokens (verl draws from torch's global generator)."""


@dataclass(frozen=True)
class ClipSettings:
    """vanilla (and bypass mode's ppo_clip): PPO's clip range and dual clip."""

    clip_ratio_low: float
    """actor.clip_ratio_low, or clip_ratio when unset."""
    clip_ratio_high: float
    """actor.clip_ratio_high, or clip_ratio when unset (above clip_ratio_low: DAPO's clip-higher)."""
    clip_ratio_c: float
    """actor.clip_ratio_c, the dual clip's bound on −A·ρ where A < 0 (> 1)."""

    def __post_init__(self) -> None:
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {self.clip_ratio_c}")


@dataclass(frozen=True)
class DPPOSettings:
    """dppo_tv and dppo_kl (arXiv:2602.04879): clip_ratio_low/high bound the divergence (the
    probability difference, or the binary KL) instead of the ratio; clip_ratio_c truncates ρ."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float


@dataclass(frozen=True)
class ClipRangeSettings:
    """gspo, cispo and geo_mean: a clip range of the ratio (its log-ratio for geo_mean)."""

    clip_ratio_low: float
    clip_ratio_high: float


@dataclass(frozen=True)
class SAPOSettings:
    """sapo (arXiv:2511.20347): the soft gate's temperatures for A > 0 and A ≤ 0 (actor.tau_pos,
    actor.tau_neg)."""

    tau_pos: float
    tau_neg: float


@dataclass(frozen=True)
class GPGSettings:
    """gpg: the plain policy gradient −A·log π_θ, no settings."""


@dataclass(frozen=True)
class ClipCovSettings:
    """clip_cov (arXiv:2505.22617): PPO's clip, and the gradient of a random clip_cov_ratio share of
    the tokens whose covariance of advantage and log-prob lies in (clip_cov_lb, clip_cov_ub) cut."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float

    def __post_init__(self) -> None:
        if self.clip_cov_ratio <= 0:
            raise ValueError(f"clip_cov_ratio must be > 0, got {self.clip_cov_ratio}")


@dataclass(frozen=True)
class KLCovSettings:
    """kl_cov (arXiv:2505.22617): the kl_cov_ratio share of tokens with the largest covariance of
    advantage and log-prob get ppo_kl_coef·|log ρ| added."""

    kl_cov_ratio: float
    ppo_kl_coef: float

    def __post_init__(self) -> None:
        if self.kl_cov_ratio <= 0:
            raise ValueError(f"kl_cov_ratio must be > 0, got {self.kl_cov_ratio}")


@dataclass(frozen=True)
class DROSettings:
    """dro: −(A·log π_θ − ½·dro_beta·(log ρ)²)."""

    dro_beta: float

    def __post_init__(self) -> None:
        if not self.dro_beta > 0:
            raise ValueError(f"dro_beta must be > 0, got {self.dro_beta}")


@dataclass(frozen=True)
class BypassSettings:
    """bypass_mode: the old log-probs are the rollout's; importance weights and rejection of the
    current policy against the rollout's are taken inside the loss (algorithm.rollout_correction)."""

    loss_type: BypassLossType
    clip: ClipSettings
    correction: RolloutCorrectionSettings
