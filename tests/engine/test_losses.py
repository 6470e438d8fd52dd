import math

import pytest
import torch

from ppoflow.engine.logits import logprobs_from_logits
from ppoflow.engine.losses import compute_value_loss, explained_variance
from ppoflow.engine.masking import LOSS_AGG_MODES, Aggregation, mini_batch_aggregation
from ppoflow.engine.policy_losses import ClipSettings, PolicyLossSpec, PolicyTokens
from ppoflow.engine.policy_losses import compute_policy_loss as registry_loss

CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean"}


def compute_policy_loss(
    old_log_probs,
    log_probs,
    advantages,
    mask,
    *,
    clip_ratio_low,
    clip_ratio_high,
    clip_ratio_c,
    loss_agg_mode,
    agg=None,
):
    """The vanilla loss (PPO's clipped surrogate with dual clip) through the registry."""
    spec = PolicyLossSpec("vanilla", ClipSettings(clip_ratio_low, clip_ratio_high, clip_ratio_c))
    tokens = PolicyTokens(old_log_probs, log_probs, advantages, mask)
    return registry_loss(spec, tokens, agg or Aggregation(loss_agg_mode))


def policy_loss(advantages, ratios, **overrides):
    """compute_policy_loss on one row of tokens with old_log_probs = 0 and log_probs = log(ratio)."""
    log_probs = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([advantages], dtype=torch.float64)
    loss, metrics = compute_policy_loss(
        torch.zeros_like(log_probs), log_probs, advantages, torch.ones_like(advantages), **(CLIP | overrides)
    )
    loss.backward()
    return loss.item(), metrics, log_probs.grad[0].tolist()


@pytest.mark.parametrize(
    ("advantage", "ratio", "expected", "clipfrac", "clipfrac_lower"),
    [
        (1.0, 1.5, -1.2, 1.0, 0.0),  # ρ clipped at 1 + ε
        (-1.0, 0.5, 0.8, 1.0, 0.0),  # ρ clipped at 1 − ε
        (-1.0, 5.0, 3.0, 0.0, 1.0),  # L1 = 5, L2 = 1.2, Lc = 5, L3 = 3: dual clip
        (1.0, 1.1, -1.1, 0.0, 0.0),  # inside the trust region
        (-1.0, 1.1, 1.1, 0.0, 0.0),  # A < 0, ρ > 1: L1 = 1.1 > L2 = 1.0 and below c
    ],
)
def test_ppo_clip_vectors(advantage, ratio, expected, clipfrac, clipfrac_lower):
    loss, metrics, _ = policy_loss([advantage], [ratio])
    assert loss == pytest.approx(expected)
    assert metrics["actor/pg_clipfrac"] == clipfrac
    assert metrics["actor/pg_clipfrac_lower"] == clipfrac_lower
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(ratio))


def test_policy_loss_batch_metrics_and_gradients():
    loss, metrics, grad = policy_loss([1.0, -1.0, -1.0, 1.0], [1.5, 0.5, 5.0, 1.1])
    assert loss == pytest.approx((-1.2 + 0.8 + 3.0 - 1.1) / 4)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["actor/pg_clipfrac"] == 0.5
    assert metrics["actor/pg_clipfrac_lower"] == 0.25
    assert metrics["actor/ppo_kl"] == pytest.approx(-sum(map(math.log, [1.5, 0.5, 5.0, 1.1])) / 4)
    # clipped tokens get no gradient; d(−A·ρ)/d log π = −A·ρ, over 4 tokens
    assert grad == pytest.approx([0.0, 0.0, 0.0, -1.1 / 4])


def test_clip_higher_raises_only_the_upper_bound():
    high = {"clip_ratio_high": 0.28}
    assert policy_loss([1.0], [1.25], **high)[0] == pytest.approx(-1.25)
    assert policy_loss([1.0], [1.25])[0] == pytest.approx(-1.2)
    assert policy_loss([1.0], [1.5], **high)[0] == pytest.approx(-1.28)
    assert policy_loss([-1.0], [0.7], **high)[0] == pytest.approx(0.8)


def test_dual_clip_bound_follows_clip_ratio_c():
    assert policy_loss([-1.0], [5.0], clip_ratio_c=10.0)[0] == pytest.approx(5.0)
    assert policy_loss([-2.0], [5.0], clip_ratio_c=3.0)[0] == pytest.approx(6.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss([1.0], [1.0], clip_ratio_c=1.0)


def test_extreme_log_ratio_is_clamped():
    loss, metrics, _ = policy_loss([1.0], [math.exp(50.0)], clip_ratio_high=1e9)
    assert loss == pytest.approx(-math.exp(20.0))
    assert metrics["actor/ppo_kl"] == pytest.approx(-20.0)


def random_policy_batch(seed, n=4, t=6):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(n, t, generator=gen) > 0.3).long()
    old = -torch.rand(n, t, generator=gen, dtype=torch.float64) * 3
    new = old + 0.4 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    advantages = torch.randn(n, t, generator=gen, dtype=torch.float64)
    return old, new, advantages, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_ignores_masked_positions(mode):
    old, new, advantages, mask = random_policy_batch(0)
    masked = ~mask.bool()
    results = []
    for garbage in (0.0, 1e3):
        log_probs = torch.where(masked, -garbage, new).requires_grad_(True)
        loss, metrics = compute_policy_loss(
            torch.where(masked, garbage, old),
            log_probs,
            torch.where(masked, -garbage, advantages),
            mask,
            **(CLIP | {"loss_agg_mode": mode}),
        )
        loss.backward()
        results.append((loss.item(), metrics, log_probs.grad))
    assert results[0][0] == pytest.approx(results[1][0])
    assert results[0][1] == pytest.approx(results[1][1])
    torch.testing.assert_close(results[0][2], results[1][2])
    assert results[1][2][masked].abs().sum().item() == 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_ignores_masked_positions(mode):
    values, vpreds, returns, mask = random_policy_batch(1)
    masked = ~mask.bool()
    results = []
    for garbage in (0.0, 1e3):
        preds = torch.where(masked, garbage, vpreds).requires_grad_(True)
        loss, metrics = compute_value_loss(
            preds,
            torch.where(masked, -garbage, values),
            torch.where(masked, garbage * 2, returns),
            mask,
            cliprange_value=0.2,
            agg=Aggregation(mode),
        )
        loss.backward()
        results.append((loss.item(), metrics, preds.grad))
    assert results[0][0] == pytest.approx(results[1][0])
    assert results[0][1] == pytest.approx(results[1][1])
    torch.testing.assert_close(results[0][2], results[1][2])


def test_value_loss_hand_numbers():
    # ε_v = 0.5, R = 2. v = 1.2: both 0.64; v = 3: max(1, 0.25) = 1; v = 2, v_old = 0: clip 0.5 → 2.25
    vpreds = torch.tensor([[1.2, 3.0, 2.0, 50.0]])
    values = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 2.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = compute_value_loss(
        vpreds, values, returns, mask, cliprange_value=0.5, agg=Aggregation("token-mean")
    )
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.0 + 2.25) / 3)
    assert metrics == {"critic/vf_clipfrac": pytest.approx(1 / 3)}


def test_explained_variance_hand_case():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]])
    values = torch.tensor([[1.0, 2.0, 3.0, 3.0, -100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # R − V = [0, 0, 0, 1]: unbiased var 0.25; Var(R) = 5/3
    assert explained_variance(returns, values, mask) == pytest.approx(1 - 0.25 / (5 / 3 + 1e-5))


def test_explained_variance_of_constant_returns_is_hugely_negative():
    returns, values = torch.zeros(1, 2), torch.tensor([[1.0, -1.0]])
    assert explained_variance(returns, values, torch.ones(1, 2)) == pytest.approx(1 - 2.0 / 1e-5)  # −199999


T, D, V, ROWS = 5, 3, 7, 8
LENGTHS = [5, 3, 1, 0, 4, 2, 5, 1]  # uneven, and row 3 is empty


def accumulation_batch():
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(ROWS, T, D, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, V, (ROWS, T), generator=gen)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    advantages = torch.randn(ROWS, T, generator=gen, dtype=torch.float64)
    noise = 0.5 * torch.randn(ROWS, T, generator=gen, dtype=torch.float64)
    return features, labels, mask, advantages, noise


def policy_gradient(micro_batch_size, mode, shared_denominator=True):
    """Gradient of the tiny policy's weight after one mini-batch split into micro-batches."""
    features, labels, mask, advantages, noise = accumulation_batch()
    model = torch.nn.Linear(D, V, bias=False, dtype=torch.float64)
    torch.nn.init.normal_(model.weight, generator=torch.Generator().manual_seed(1))
    old = (logprobs_from_logits(model(features), labels) + noise).detach()  # ρ ≠ 1, so clipping fires
    agg = mini_batch_aggregation(mask, mode) if shared_denominator else None
    for rows in torch.arange(ROWS).split(micro_batch_size):
        log_probs = logprobs_from_logits(model(features[rows]), labels[rows])
        loss, _ = compute_policy_loss(
            old[rows],
            log_probs,
            advantages[rows],
            mask[rows],
            **(CLIP | {"loss_agg_mode": mode}),
            agg=agg,
        )
        loss.backward()
    return model.weight.grad


def value_gradient(micro_batch_size, mode):
    features, _, mask, returns, noise = accumulation_batch()
    critic = torch.nn.Linear(D, 1, bias=False, dtype=torch.float64)
    torch.nn.init.normal_(critic.weight, generator=torch.Generator().manual_seed(2))
    old_values = (critic(features).squeeze(-1) + noise).detach()
    agg = mini_batch_aggregation(mask, mode)
    for rows in torch.arange(ROWS).split(micro_batch_size):
        vpreds = critic(features[rows]).squeeze(-1)
        loss, _ = compute_value_loss(
            vpreds,
            old_values[rows],
            returns[rows],
            mask[rows],
            cliprange_value=0.2,
            agg=agg,
        )
        loss.backward()
    return critic.weight.grad


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_accumulation_1x8_equals_4x2(mode):
    torch.testing.assert_close(policy_gradient(2, mode), policy_gradient(8, mode), atol=1e-6, rtol=0)
    torch.testing.assert_close(value_gradient(2, mode), value_gradient(8, mode), atol=1e-6, rtol=0)
    assert policy_gradient(8, mode).abs().sum().item() > 0


def test_per_micro_batch_denominators_would_break_accumulation():
    separate = policy_gradient(2, "token-mean", shared_denominator=False)
    assert not torch.allclose(separate, policy_gradient(8, "token-mean"), atol=1e-6)
