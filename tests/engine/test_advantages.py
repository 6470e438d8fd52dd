import math
import statistics

import pytest
import torch

from ppoflow.engine.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageSpec,
    DiscountSettings,
    GAESettings,
    GDPOSettings,
    GRPOSettings,
    NoSettings,
    TokenBaselineSettings,
    compute_advantages,
    group_score_spread_zero_fraction,
)
from ppoflow.engine.group_advantages import grpo, reinforce_plus_plus_baseline, rloo
from ppoflow.engine.token_advantages import gae, reinforce_plus_plus, remax


def compute_gae(rewards, values, mask, *, gamma, lam):
    """The raw GAE scan (before whitening): advantages and returns."""
    whitened, returns = gae(AdvantageInputs(rewards, mask, values=values), GAESettings(gamma, lam))
    return returns - values, returns


def compute_grpo_outcome_advantage(rewards, mask, group_id, norm_adv_by_std=True):
    return grpo(AdvantageInputs(rewards, mask, group_id), GRPOSettings(norm_adv_by_std))


def compute_rloo_outcome_advantage(rewards, mask, group_id):
    return rloo(AdvantageInputs(rewards, mask, group_id), NoSettings())


def compute_reinforce_plus_plus_advantage(rewards, mask, *, gamma):
    return reinforce_plus_plus(AdvantageInputs(rewards, mask), DiscountSettings(gamma))


def compute_reinforce_plus_plus_baseline_advantage(rewards, mask, group_id):
    return reinforce_plus_plus_baseline(AdvantageInputs(rewards, mask, group_id), NoSettings())


def compute_remax_advantage(rewards, baselines, mask):
    return remax(AdvantageInputs(rewards, mask, reward_baselines=baselines), NoSettings())


SETTINGS = {
    "gae": GAESettings(0.9, 0.95),
    "grpo": GRPOSettings(True),
    "grpo_passk": GRPOSettings(True),
    "gdpo": GDPOSettings(("correctness", "format"), None),
    "optimal_token_baseline": TokenBaselineSettings(),
    "tir_optimal_token_baseline": TokenBaselineSettings(),
    "reinforce_plus_plus": DiscountSettings(0.9),
}


def estimate(estimator, **inputs):
    """compute_advantages of `estimator` with its test settings."""
    spec = AdvantageSpec(estimator, SETTINGS.get(estimator, NoSettings()))
    return compute_advantages(spec, AdvantageInputs(**inputs))


def reference_gae(rewards, values, mask, gamma, lam):
    """Plain-python backward scan of ALGORITHMS.md, one row at a time."""
    advantages = []
    for r_row, v_row, m_row in zip(rewards, values, mask, strict=True):
        next_value, next_adv, row = 0.0, 0.0, [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            delta = r_row[t] + gamma * next_value - v_row[t]
            adv = delta + gamma * lam * next_adv
            if m_row[t]:
                next_value, next_adv = v_row[t], adv
            row[t] = next_adv
        advantages.append(row)
    return advantages


def reference_grpo(scores, group_id, norm_by_std, epsilon=1e-6):
    """Plain-python GRPO: per-group mean and unbiased std, a group of one has mean 0 and std 1."""
    groups = {}
    for score, gid in zip(scores, group_id, strict=True):
        groups.setdefault(gid, []).append(score)
    out = []
    for score, gid in zip(scores, group_id, strict=True):
        members = groups[gid]
        mean, std = (0.0, 1.0) if len(members) == 1 else (statistics.mean(members), statistics.stdev(members))
        out.append((score - mean) / (std + epsilon) if norm_by_std else score - mean)
    return out


def random_batch(seed, n=6, t=9):
    """Random rewards, values and right-padded masks (lengths 1..t), with score at the last valid token."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    rewards = torch.randn(n, t, generator=gen, dtype=torch.float64) * mask
    values = torch.randn(n, t, generator=gen, dtype=torch.float64)
    return rewards, values, mask


def test_gae_vector_gamma_lam_one():
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.5, 0.5]])
    advantages, returns = compute_gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5, 0.5]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_vector_gamma_half():
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.5, 0.5]])
    advantages, _ = compute_gae(rewards, values, torch.ones(1, 3), gamma=0.5, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[-0.25, 0.0, 0.5]]))


@pytest.mark.parametrize("seed", range(3))
def test_gae_gamma_lam_one_is_reward_to_go_minus_value(seed):
    rewards, values, mask = random_batch(seed)
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    valid = mask.bool()
    torch.testing.assert_close(advantages[valid], (reward_to_go - values)[valid])
    torch.testing.assert_close(returns[valid], reward_to_go[valid])


@pytest.mark.parametrize("seed", range(5))
def test_gae_matches_reference_loop_with_random_masks(seed):
    rewards, values, _ = random_batch(seed)
    mask = (torch.rand(rewards.shape, generator=torch.Generator().manual_seed(seed)) > 0.3).long()
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.95)
    expected = torch.tensor(reference_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.9, 0.95))
    torch.testing.assert_close(advantages, expected.to(advantages.dtype))
    torch.testing.assert_close(returns, advantages + values)


def test_gae_ignores_values_and_rewards_at_masked_positions():
    rewards, values, _ = random_batch(7)
    mask = (torch.rand(rewards.shape, generator=torch.Generator().manual_seed(1)) > 0.4).long()
    masked = ~mask.bool()
    garbage = torch.full_like(rewards, 1e6)
    rewards2, values2 = torch.where(masked, garbage, rewards), torch.where(masked, float("nan"), values)
    for gamma, lam in [(1.0, 1.0), (0.9, 0.8)]:
        adv1, ret1 = compute_gae(rewards, values, mask, gamma=gamma, lam=lam)
        adv2, ret2 = compute_gae(rewards2, values2, mask, gamma=gamma, lam=lam)
        torch.testing.assert_close(adv1[mask.bool()], adv2[mask.bool()])
        torch.testing.assert_close(ret1[mask.bool()], ret2[mask.bool()])
        spec = AdvantageSpec("gae", GAESettings(gamma, lam))
        out1 = compute_advantages(spec, AdvantageInputs(rewards, mask, values=values))
        out2 = compute_advantages(spec, AdvantageInputs(rewards2, mask, values=values2))
        torch.testing.assert_close(out1, out2)


def test_compute_advantages_gae_whitens_and_zeroes_padding():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.5, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    advantages, returns = compute_advantages(
        AdvantageSpec("gae", GAESettings(0.5, 1.0)), AdvantageInputs(rewards, mask, values=values)
    )
    raw = [-0.25, 0.0, 0.5]
    mu, sigma = statistics.mean(raw), statistics.stdev(raw)  # stdev is the unbiased one
    torch.testing.assert_close(advantages, torch.tensor([[(a - mu) / sigma for a in raw] + [0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.25, 0.5, 1.0, 0.0]]))


def test_grpo_one_group_vector():
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]])
    advantages, returns = compute_grpo_outcome_advantage(
        rewards, torch.ones(4, 1), torch.zeros(4, dtype=torch.long)
    )
    torch.testing.assert_close(advantages[:, 0], torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]))
    torch.testing.assert_close(returns, advantages)


TWO_GROUPS_REWARDS = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
TWO_GROUPS_MASK = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 1]])
TWO_GROUPS_ID = torch.tensor([7, 7, 7, 3, 3, 3])


def test_grpo_two_groups_vector_and_mask():
    advantages, _ = compute_grpo_outcome_advantage(TWO_GROUPS_REWARDS, TWO_GROUPS_MASK, TWO_GROUPS_ID)
    expected = torch.tensor([0.57735, -1.154700, 0.57735, 1.154700, -0.57735, -0.57735])
    torch.testing.assert_close(advantages, expected[:, None] * TWO_GROUPS_MASK, atol=1e-5, rtol=0)


def test_dr_grpo_two_groups_vector():
    advantages, _ = compute_grpo_outcome_advantage(
        TWO_GROUPS_REWARDS, TWO_GROUPS_MASK, TWO_GROUPS_ID, norm_adv_by_std=False
    )
    torch.testing.assert_close(advantages[:, 0], torch.tensor([1, -2, 1, 2, -1, -1]) / 3.0)


def test_rloo_two_groups_vector():
    advantages, _ = compute_rloo_outcome_advantage(TWO_GROUPS_REWARDS, TWO_GROUPS_MASK, TWO_GROUPS_ID)
    torch.testing.assert_close(advantages[:, 0], torch.tensor([0.5, -1.0, 0.5, 1.0, -0.5, -0.5]))


def test_group_of_one_keeps_its_score():
    rewards, mask, group_id = (
        torch.tensor([[0.0, 3.0], [2.0, 0.0]]),
        torch.tensor([[1, 1], [1, 0]]),
        torch.tensor([0, 1]),
    )
    rloo, _ = compute_rloo_outcome_advantage(rewards, mask, group_id)
    torch.testing.assert_close(rloo, torch.tensor([[3.0, 3.0], [2.0, 0.0]]))
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, group_id)
    torch.testing.assert_close(grpo, rloo / (1.0 + 1e-6))


def test_grpo_equal_scores_give_zero_advantage():
    advantages, _ = compute_grpo_outcome_advantage(
        torch.ones(3, 2), torch.ones(3, 2), torch.zeros(3, dtype=torch.long)
    )
    assert advantages.abs().max().item() == 0.0


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_grpo_matches_reference_loop(seed, norm_by_std):
    rewards, _, mask = random_batch(seed, n=12)
    group_id = torch.randint(0, 4, (12,), generator=torch.Generator().manual_seed(seed))
    advantages, _ = compute_grpo_outcome_advantage(rewards, mask, group_id, norm_adv_by_std=norm_by_std)
    scores = (rewards * mask).sum(-1).tolist()
    expected = torch.tensor(reference_grpo(scores, group_id.tolist(), norm_by_std), dtype=rewards.dtype)
    torch.testing.assert_close(advantages, expected[:, None] * mask)


def test_reinforce_plus_plus_reward_to_go_ignores_what_follows_eos():
    rewards = torch.tensor([[0.0, 1.0, 5.0, 7.0], [0.0, 0.0, 0.0, 2.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    advantages, returns = compute_reinforce_plus_plus_advantage(rewards, mask, gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.5, 1.0, 0.0, 0.0], [0.25, 0.5, 1.0, 2.0]]))
    valid = [0.5, 1.0, 0.25, 0.5, 1.0, 2.0]
    mu, sigma = statistics.mean(valid), statistics.stdev(valid)
    expected = torch.tensor(
        [[(0.5 - mu) / sigma, (1.0 - mu) / sigma, 0.0, 0.0], [(g - mu) / sigma for g in valid[2:]]]
    )
    torch.testing.assert_close(advantages, expected)


def test_reinforce_plus_plus_carries_the_return_through_a_masked_span():
    """verl ≥ 0.9.0: a masked span inside a response (tool output in a multi-turn rollout) passes the
    running return through; older verl reset it there, giving [0, 0, 0, 0, 1, 1]."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    _, returns = compute_reinforce_plus_plus_advantage(rewards, mask, gamma=1.0)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]))
    # the masked span neither adds its rewards (NaN included) nor discounts: γ = 0.5
    rewards = torch.tensor([[0.0, 0.0, 9.0, math.nan, 0.0, 1.0]])
    advantages, returns = compute_reinforce_plus_plus_advantage(rewards, mask, gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.125, 0.25, 0.0, 0.0, 0.5, 1.0]]))
    valid = [0.125, 0.25, 0.5, 1.0]
    mu, sigma = statistics.mean(valid), statistics.stdev(valid)
    whitened = [(g - mu) / sigma for g in valid]
    expected = torch.tensor([[whitened[0], whitened[1], 0.0, 0.0, whitened[2], whitened[3]]])
    torch.testing.assert_close(advantages, expected)


def test_reinforce_plus_plus_baseline_hand_case():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1]])
    advantages, returns = compute_reinforce_plus_plus_baseline_advantage(
        rewards, mask, torch.tensor([0, 0, 1, 1])
    )
    tokens = [0.5, 0.5, -0.5, 0.0, 0.0, 0.0]  # s − mean_g per valid token: groups [1, 0] and [1, 1]
    mu, sigma = statistics.mean(tokens), statistics.stdev(tokens)
    w = [(x - mu) / sigma for x in tokens]
    torch.testing.assert_close(
        advantages, torch.tensor([[w[0], w[1]], [w[2], 0.0], [w[3], 0.0], [w[4], w[5]]])
    )
    torch.testing.assert_close(returns, advantages)


def test_remax_hand_case():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = compute_remax_advantage(rewards, torch.tensor([0.3, 0.5]), mask)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.7, 0.7, 0.7], [1.5, 1.5, 0.0]]))


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_is_zero_at_masked_positions(estimator):
    rewards, values, mask = random_batch(11, n=8)
    gen = torch.Generator().manual_seed(3)
    advantages, returns = estimate(
        estimator,
        token_level_rewards=rewards,
        response_mask=mask,
        values=values,
        group_id=torch.arange(8) // 4,
        reward_baselines=torch.randn(8, dtype=rewards.dtype, generator=gen),
        old_log_probs=-torch.rand(rewards.shape, dtype=rewards.dtype, generator=gen),
        sum_pi_squared=torch.rand(rewards.shape, dtype=rewards.dtype, generator=gen),
        reward_components={
            "correctness": torch.randint(0, 2, (8,), generator=gen).double(),
            "format": torch.rand(8, generator=gen, dtype=torch.float64),
        },
    )
    masked = ~mask.bool()
    assert advantages[masked].abs().sum().item() == 0.0
    assert returns[masked].abs().sum().item() == 0.0
    assert advantages[~masked].abs().sum().item() > 0.0


def test_compute_advantages_dispatch_matches_direct_calls():
    group_id = torch.tensor([7, 7, 7, 3, 3, 3])
    inputs = AdvantageInputs(TWO_GROUPS_REWARDS, TWO_GROUPS_MASK, group_id)
    direct = compute_grpo_outcome_advantage(
        TWO_GROUPS_REWARDS, TWO_GROUPS_MASK, group_id, norm_adv_by_std=False
    )
    torch.testing.assert_close(compute_advantages(AdvantageSpec("grpo", GRPOSettings(False)), inputs), direct)
    direct = compute_rloo_outcome_advantage(TWO_GROUPS_REWARDS, TWO_GROUPS_MASK, group_id)
    torch.testing.assert_close(compute_advantages(AdvantageSpec("rloo", NoSettings()), inputs), direct)


@pytest.mark.parametrize("estimator", sorted(e for e, entry in ADVANTAGE_ESTIMATORS.items() if entry.needs))
def test_missing_input_raises_naming_it(estimator):
    needs = ADVANTAGE_ESTIMATORS[estimator].needs
    with pytest.raises(ValueError, match=sorted(needs)[0]):
        estimate(estimator, token_level_rewards=torch.zeros(2, 2), response_mask=torch.ones(2, 2))


def test_unknown_estimator_and_wrong_settings_are_refused():
    with pytest.raises(ValueError, match="gae.*grpo.*remax"):
        AdvantageSpec("ppo", NoSettings())
    with pytest.raises(TypeError, match="GAESettings"):
        AdvantageSpec("gae", NoSettings())


def test_group_score_spread_zero_fraction():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    group_id = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # groups 0 and 2 are flat, 3 is alone (flat), 1 is spread
    assert group_score_spread_zero_fraction(scores, group_id) == pytest.approx(0.75)
    assert group_score_spread_zero_fraction(torch.tensor([]), torch.tensor([], dtype=torch.long)) == 0.0


def verl_grpo(scores: torch.Tensor, group_id: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """verl 0.9.1's compute_grpo_outcome_advantage: per group torch.mean and torch.std of the stacked
    scores, in the scores' dtype; a group of one has mean 0 and std 1 (float32 tensors)."""
    members: dict[int, list[torch.Tensor]] = {}
    for score, gid in zip(scores, group_id.tolist(), strict=True):
        members.setdefault(gid, []).append(score)
    out = torch.empty_like(scores)
    for i, gid in enumerate(group_id.tolist()):
        group = torch.stack(members[gid])
        if len(group) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)  # float32, as verl's
        else:
            mean, std = torch.mean(group), torch.std(group)
        out[i] = (scores[i] - mean) / (std + epsilon)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", [0.1, 0.7, 1.1, 10.1])
def test_a_group_of_equal_scores_gets_exactly_zero_whatever_its_size_value_and_dtype(dtype, value):
    """verl gives 64 × 1.1 in float32 an advantage of 0.416 and 32 × 10.1 one of 0.484: the rounded
    group mean divided by std + 1e-6. No signal must mean no push."""
    for size in [*range(2, 33), 64, 100, 128, 255, 256]:  # (a group of one keeps its score)
        rewards = torch.full((size, 1), value, dtype=dtype)
        group_id = torch.zeros(size, dtype=torch.long)
        mask = torch.ones(size, 1)
        grpo, _ = compute_grpo_outcome_advantage(rewards, mask, group_id)
        dr_grpo, _ = compute_grpo_outcome_advantage(rewards, mask, group_id, norm_adv_by_std=False)
        rloo, _ = compute_rloo_outcome_advantage(rewards, mask, group_id)
        for name, advantages in (("grpo", grpo), ("dr_grpo", dr_grpo), ("rloo", rloo)):
            assert torch.equal(advantages, torch.zeros_like(rewards)), (name, size, advantages.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(3))
def test_grpo_equals_verl_on_groups_with_spread(dtype, seed):
    """Groups of 1–256 with 0/1 scores, graded scores and noise: every group with a spread gets
    verl's advantage bit for bit (per-group torch.mean/torch.std in the scores' dtype)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 5, 8, 16, 17, 32, 64, 100, 128, 256]
    scores, group_id = [], []
    for gid, size in enumerate(sizes):
        kind = (gid + seed) % 3
        if kind == 0:
            group = torch.randint(0, 2, (size,), generator=gen).to(dtype) * 1.1
            group[0] = 1.1
            group[-1] = 0.0 if size > 1 else group[-1]
        elif kind == 1:
            group = torch.randint(0, 11, (size,), generator=gen).to(dtype) / 10
        else:
            group = torch.randn(size, generator=gen, dtype=dtype) * 3 + 10.1
        scores.append(group)
        group_id += [gid] * size
    scores = torch.cat(scores)
    group_id = torch.tensor(group_id)
    advantages, _ = compute_grpo_outcome_advantage(scores[:, None], torch.ones(len(scores), 1), group_id)
    assert torch.equal(advantages[:, 0], verl_grpo(scores, group_id))  # verl's operations, in its dtype
