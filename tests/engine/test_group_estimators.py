"""The estimators verl 0.9.1 added beside GRPO (grpo_vectorized, grpo_passk, rloo_vectorized, opo,
gpg, gdpo) and the optimal token baselines, on hand-computed cases; their equality with verl's own
functions is tests/engine/test_verl_reference.py's."""

import pytest
import torch

from ppoflow.engine.advantages import (
    AdvantageInputs,
    AdvantageSpec,
    GDPOSettings,
    GRPOSettings,
    NoSettings,
    TokenBaselineSettings,
    compute_advantages,
)


def outcome(scores: list[float], lengths: list[int] | None = None, width: int = 3):
    """Rewards with each score on the row's last valid token, and the mask of `lengths` (all `width`)."""
    lengths = lengths or [width] * len(scores)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    rewards = torch.zeros(len(scores), width, dtype=torch.float64)
    for row, (score, length) in enumerate(zip(scores, lengths, strict=True)):
        rewards[row, length - 1] = score
    return rewards, mask


def first_token(name, settings, rewards, mask, group_id, **more):
    advantages, returns = compute_advantages(
        AdvantageSpec(name, settings), AdvantageInputs(rewards, mask, group_id, **more)
    )
    return advantages[:, 0].tolist(), advantages, returns


def test_grpo_passk_gives_only_the_best_response_the_gap_to_the_second():
    rewards, mask = outcome([1.0, 0.0, 0.5])
    firsts, _, _ = first_token(
        "grpo_passk", GRPOSettings(True), rewards, mask, torch.zeros(3, dtype=torch.long)
    )
    assert firsts == pytest.approx([0.5 / (0.5 + 1e-6), 0.0, 0.0])  # std of [1, 0, 0.5] is 0.5
    firsts, _, _ = first_token(
        "grpo_passk", GRPOSettings(False), rewards, mask, torch.zeros(3, dtype=torch.long)
    )
    assert firsts == pytest.approx([0.5, 0.0, 0.0])


def test_grpo_passk_refuses_a_group_of_one():
    rewards, mask = outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="at least 2 responses"):
        first_token("grpo_passk", GRPOSettings(True), rewards, mask, torch.tensor([0, 1]))


def test_opo_baseline_is_the_length_weighted_mean():
    rewards, mask = outcome([1.0, 0.0], lengths=[2, 1])
    firsts, advantages, _ = first_token("opo", NoSettings(), rewards, mask, torch.zeros(2, dtype=torch.long))
    assert firsts == pytest.approx([1 / 3, -2 / 3])  # baseline (2·1 + 1·0) / 3
    assert advantages[0, 2].item() == 0.0 and advantages[1, 1].item() == 0.0


def test_gpg_scales_by_the_share_of_rows_with_a_score():
    rewards, mask = outcome([1.0, 0.0, 1.0, 1.0])
    firsts, _, _ = first_token("gpg", NoSettings(), rewards, mask, torch.zeros(4, dtype=torch.long))
    assert firsts == pytest.approx([4 / 3 * 0.25, -4 / 3 * 0.75, 4 / 3 * 0.25, 4 / 3 * 0.25])


def test_rloo_vectorized_gives_a_group_of_one_zero_where_rloo_keeps_its_score():
    rewards, mask = outcome([1.0, 0.0, 2.0])
    group_id = torch.tensor([0, 0, 1])
    vectorized, _, _ = first_token("rloo_vectorized", NoSettings(), rewards, mask, group_id)
    looped, _, _ = first_token("rloo", NoSettings(), rewards, mask, group_id)
    assert vectorized == pytest.approx([1.0, -1.0, 0.0])
    assert looped == pytest.approx([1.0, -1.0, 2.0])


def test_grpo_vectorized_takes_its_group_statistics_in_float32():
    rewards, mask = outcome([0.1, 0.2, 0.4])
    firsts, _, _ = first_token(
        "grpo_vectorized", NoSettings(), rewards, mask, torch.zeros(3, dtype=torch.long)
    )
    narrow = torch.tensor([0.1, 0.2, 0.4], dtype=torch.float32)
    mean, std = narrow.sum() / 3, torch.sqrt(((narrow - narrow.sum() / 3) ** 2).sum() / 2)
    expected = (torch.tensor([0.1, 0.2, 0.4], dtype=torch.float64) - mean) / (std + 1e-6)
    assert firsts == expected.tolist()


def test_gdpo_normalises_each_component_in_its_group_then_whitens():
    rewards, mask = outcome([0.0, 0.0, 0.0, 0.0], width=1)
    components = {
        "correctness": torch.tensor([1.0, 0.0, 1.0, 1.0]),
        "format": torch.tensor([1.0, 1.0, 0.0, 1.0]),
    }
    group_id = torch.tensor([0, 0, 1, 1])
    settings = GDPOSettings(("correctness", "format"), (1.0, 2.0))
    firsts, _, _ = first_token("gdpo", settings, rewards, mask, group_id, reward_components=components)
    a = 1 / (2**0.5 + 1e-6)  # a group of [1, 0]: ±1/√2 with std √½·… (unbiased std √0.5)
    summed = torch.tensor([a, -a, 0.0, 0.0]) + 2 * torch.tensor([0.0, 0.0, -a, a])  # group 0 format equal
    expected = (summed - summed.mean()) / torch.sqrt(summed.var() + 1e-8)
    assert firsts == pytest.approx(expected.tolist(), abs=1e-6)


def test_gdpo_names_a_missing_component():
    rewards, mask = outcome([0.0, 0.0], width=1)
    settings = GDPOSettings(("correctness", "length"), None)
    with pytest.raises(ValueError, match="length.*correctness"):
        first_token(
            "gdpo",
            settings,
            rewards,
            mask,
            torch.tensor([0, 0]),
            reward_components={"correctness": torch.ones(2)},
        )


@pytest.mark.parametrize("estimator", ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "gpg"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_group_of_equal_scores_gets_exactly_zero_from_every_group_estimator(estimator, dtype):
    for size in (2, 3, 7, 64, 100):
        rewards = torch.full((size, 1), 0.7, dtype=dtype)
        settings = GRPOSettings(True) if estimator == "grpo" else NoSettings()
        _, advantages, _ = first_token(
            estimator, settings, rewards, torch.ones(size, 1), torch.zeros(size, dtype=torch.long)
        )
        assert torch.equal(advantages, torch.zeros_like(advantages)), (estimator, size)


def otb_inputs(lengths):
    rewards, mask = outcome([1.0, 0.0][: len(lengths)], lengths=lengths, width=max(lengths))
    half = torch.full(rewards.shape, 0.5, dtype=torch.float64)
    return rewards, mask, {"old_log_probs": half.log(), "sum_pi_squared": half}


def test_optimal_token_baseline_hand_case():
    """π = 0.5 and Σπ² = 0.5 everywhere: w = 1 − 2·0.5 + 0.5 = 0.5 per token, W = [0.5, 1.0];
    B_t = Σ G·W / Σ W = 0.5 at both positions (G = 1 for one trajectory, 0 for the other)."""
    rewards, mask, more = otb_inputs([2, 2])
    for estimator in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        _, advantages, returns = first_token(
            estimator, TokenBaselineSettings(), rewards, mask, torch.zeros(2, dtype=torch.long), **more
        )
        torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5], [-0.5, -0.5]], dtype=torch.float64))
        torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64))


def test_optimal_token_baseline_gives_the_longest_trajectory_no_baseline_past_the_others():
    rewards, mask, more = otb_inputs([3, 1])
    _, advantages, returns = first_token(
        "optimal_token_baseline",
        TokenBaselineSettings(),
        rewards,
        mask,
        torch.zeros(2, dtype=torch.long),
        **more,
    )
    assert advantages[0, 1:].tolist() == returns[0, 1:].tolist() == [1.0, 1.0]  # no baseline past t = 1
    assert advantages[0, 0].item() == pytest.approx(1.0 - 0.5)  # B_0 = (1·0.5 + 0·0.5) / (0.5 + 0.5)
