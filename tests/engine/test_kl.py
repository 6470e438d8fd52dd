import math

import pytest
import torch

from ppoflow.engine.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty


def kl_of(d: float, kind: str) -> float:
    """kl_penalty for a single token with log_probs − ref_log_probs = d."""
    return kl_penalty(
        torch.tensor([[d]], dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64), kind
    ).item()


@pytest.mark.parametrize(
    ("kind", "d", "expected"),
    [
        ("k1", 0.1, 0.1),
        ("kl", -0.3, -0.3),
        ("abs", -0.3, 0.3),
        ("k2", 0.1, 0.005),
        ("mse", -0.4, 0.08),
        ("k3", 0.0, 0.0),
        ("low_var_kl", 0.1, math.exp(-0.1) + 0.1 - 1),  # 0.0048374
        ("k3", -0.5, math.exp(0.5) - 0.5 - 1),  # 0.1487213
    ],
)
def test_kl_penalty_hand_numbers(kind, d, expected):
    assert kl_of(d, kind) == pytest.approx(expected, abs=1e-12)


def test_k3_is_clamped():
    assert kl_of(-50.0, "k3") == 10.0  # u = clamp(50, ±20) = 20: e^20 − 21, clamped to 10
    assert kl_of(50.0, "k3") == 10.0  # u = −20: e^−20 + 19, clamped to 10
    assert kl_of(5.0, "k3") == pytest.approx(math.exp(-5) + 5 - 1)  # 4.0067, inside the clamp


def test_unknown_kl_kind_names_the_valid_choices():
    with pytest.raises(ValueError, match="k1.*low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_fixed_controller_never_moves():
    ctrl = FixedKLController(0.001)
    ctrl.update(current_kl=5.0, n_steps=64)
    assert ctrl.value == 0.001
    other = FixedKLController(0.5)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.001


def test_adaptive_controller_update_hand_numbers():
    ctrl = AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=10000)
    ctrl.update(current_kl=0.2, n_steps=64)  # e = clip(0.2 / 0.1 − 1, ±0.2) = 0.2
    assert ctrl.value == pytest.approx(0.05 * (1 + 0.2 * 64 / 10000))
    ctrl.update(current_kl=0.09, n_steps=64)  # e = −0.1, inside the clip
    assert ctrl.value == pytest.approx(0.05 * (1 + 0.2 * 64 / 10000) * (1 - 0.1 * 64 / 10000))
    ctrl.update(current_kl=0.0, n_steps=100)  # e = −1 clipped to −0.2
    assert ctrl.value == pytest.approx(0.05 * 1.00128 * 0.99936 * 0.998)


def test_adaptive_controller_state_round_trip():
    ctrl = AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=10000)
    for kl in (0.3, 0.25, 0.01):
        ctrl.update(current_kl=kl, n_steps=256)
    resumed = AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=10000)
    resumed.load_state_dict(ctrl.state_dict())
    assert resumed.value == ctrl.value
    ctrl.update(current_kl=0.2, n_steps=256)
    resumed.update(current_kl=0.2, n_steps=256)
    assert resumed.value == ctrl.value


def test_adaptive_controller_rejects_non_positive_target():
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(init_kl_coef=0.05, target_kl=0.0, horizon=10000)


def test_apply_kl_penalty_hand_numbers():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    old_log_probs = torch.tensor([[-1.0, -2.0, 30.0], [-1.0, -1.0, -1.0]])
    ref_log_probs = torch.tensor([[-1.5, -1.5, 0.0], [-1.0, -1.2, -0.4]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards, current_kl = apply_kl_penalty(scores, old_log_probs, ref_log_probs, mask, kl_coef=0.1, kind="k1")
    # k1 per token: row 0 [0.5, −0.5, (masked)], row 1 [0, 0.2, −0.6]
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 1.05, 0.0], [0.0, -0.02, 2.06]]))
    assert current_kl == pytest.approx((0.0 + (-0.4 / 3)) / 2)


def test_apply_kl_penalty_has_no_gradient():
    old_log_probs = torch.randn(2, 3, requires_grad=True)
    rewards, _ = apply_kl_penalty(
        torch.zeros(2, 3), old_log_probs, torch.zeros(2, 3), torch.ones(2, 3), kl_coef=0.1, kind="k3"
    )
    assert not rewards.requires_grad
