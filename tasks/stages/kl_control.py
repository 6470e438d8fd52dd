"""The KL coefficient β between iterations (algorithm.kl_ctrl): fixed, or adaptive (Ziegler et al.)."""

from __future__ import annotations

from ppoflow.engine.kl import AdaptiveKLController
from ppoflow.tasks.pipeline.settings import KLControlSettings


def next_kl_coef(
    kl_ctrl: KLControlSettings, coef: float, current_kl: float | None, n_responses: int
) -> float:
    """β for the next iteration. Only the adaptive controller moves, and only when a KL was measured
    (algorithm.use_kl_in_reward)."""
    if kl_ctrl.type != "adaptive" or current_kl is None:
        return coef
    controller = AdaptiveKLController(coef, kl_ctrl.target_kl, kl_ctrl.horizon)
    controller.update(current_kl, n_responses)
    return controller.value
