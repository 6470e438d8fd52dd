"""KL estimators between the policy and the reference, the in-reward penalty, and the β controllers.

Per-token estimators follow verl 0.9.1 `core_algos.kl_penalty` and John Schulman's "Approximating KL
divergence" (http://joschu.net/blog/kl-approx.html): k1 = d, k2 = ½·d², k3 = e^{−d} + d − 1 with
d = log π(a) − log π_ref(a). The adaptive controller is Ziegler et al. 2019 (arXiv:1909.08593).
"""

from typing import Any, get_args

import torch
from torch import Tensor

from .masking import masked_mean
from .names import KLPenalty

KL_PENALTIES: tuple[str, ...] = get_args(KLPenalty)


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: KLPenalty) -> Tensor:
    """Per-token KL estimate from d = log_probs − ref_log_probs (verl's `kl_penalty`).

    log_probs: (N, T) log π(a_t|s_t) of the policy. ref_log_probs: (N, T) same for the reference.
    kind: "kl"/"k1": d; "abs": |d|; "mse"/"k2": ½·d²; "low_var_kl"/"k3": u = clamp(−d, −20, 20),
    e^u − u − 1 clamped to [−10, 10]. A "+" suffix (k1+, k3+, …) keeps that value but takes the
    gradient of k2 = ½·d² (straight-through: k1 and k3 estimate the KL without bias, k2's gradient is
    the KL's). Returns (N, T); masked positions hold the estimate of whatever the inputs hold there
    (mask it before use).
    """
    if kind.endswith("+"):
        value = _kl_value(log_probs, ref_log_probs, kind[:-1])
        gradient = 0.5 * (log_probs - ref_log_probs).square()
        return gradient - gradient.detach() + value.detach()
    return _kl_value(log_probs, ref_log_probs, kind)


def _kl_value(log_probs: Tensor, ref_log_probs: Tensor, kind: str) -> Tensor:
    d = log_probs - ref_log_probs
    match kind:
        case "kl" | "k1":
            return d
        case "abs":
            return d.abs()
        case "mse" | "k2":
            return 0.5 * d.square()
        case "low_var_kl" | "k3":
            u = torch.clamp(-d, min=-20.0, max=20.0)
            return torch.clamp(u.exp() - u - 1, min=-10.0, max=10.0)
        case _:
            raise ValueError(f"unknown kl penalty {kind!r}; valid choices: {', '.join(KL_PENALTIES)}")


class FixedKLController:
    """β that never changes (`algorithm.kl_ctrl.type = fixed`)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep β: a fixed controller ignores the measured KL."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional β controller of Ziegler et al. 2019 (arXiv:1909.08593), as in verl.

    After each batch: e = clip(current_kl / target_kl − 1, −0.2, 0.2); β ← β·(1 + e·n_steps / horizon),
    n_steps being the number of responses in the batch. β is in `state_dict` so a resumed run continues
    with it (verl does not checkpoint it); target_kl and horizon come from the configuration.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl} and {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β towards the value that keeps current_kl near target_kl."""
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    *,
    kl_coef: float,
    kind: KLPenalty,
) -> tuple[Tensor, float]:
    """In-reward KL penalty (`algorithm.use_kl_in_reward`), without gradient.

    token_level_scores: (N, T) sequence score at the last valid token, 0 elsewhere.
    old_log_probs, ref_log_probs: (N, T); masked positions are ignored. response_mask: (N, T) 0/1.
    kl_coef: β (the controller's `.value`). Returns token_level_rewards = scores − β·kl·mask (N, T),
    equal to the scores at masked positions, and current_kl: the mean over all rows of each row's masked
    mean of kl (a row without valid tokens counts as 0, as in verl), to pass to the controller's `update`.
    """
    kl = torch.where(response_mask != 0, kl_penalty(old_log_probs, ref_log_probs, kind), 0.0)
    token_level_rewards = token_level_scores - kl_coef * kl
    current_kl = masked_mean(kl, response_mask, dim=-1).mean().item()
    return token_level_rewards, current_kl
