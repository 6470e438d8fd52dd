"""Update loops on the real tiny model: micro-batching never changes the update; metric names."""

import copy
import functools

import pytest
import torch

from ppoflow.engine.forward import compute_log_probs, compute_values
from ppoflow.engine.models import load_actor, load_critic, load_tokenizer
from ppoflow.engine.parallel import LocalStepper
from ppoflow.engine.ppo import build_sequence_batch
from ppoflow.engine.update import update_actor, update_critic

from .settings import actor_settings, critic_settings

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = [tokenizer(f"{a} + {b} = ")["input_ids"] for a, b in [(1, 2), (3, 4), (9, 9), (0, 5)] * 2]
    responses = [[6, 1], [12, 1], [4, 11, 1], [8], [4, 4, 4, 1], [10, 1], [5, 1], [8, 1]]
    return build_sequence_batch(prompts, responses, pad_token_id=tokenizer.pad_token_id)


def _sgd_actor_step(model, batch, micro, mode, advantages, entropy_coeff=0.01, **changes):
    old = compute_log_probs(model, batch, temperature=1.0, batching=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = actor_settings(
        ppo_epochs=1,
        mini_batch_size=8,
        micro_batch_size=micro,
        loss_agg_mode=mode,
        entropy_coeff=entropy_coeff,
        grad_clip=1e9,
        **changes,
    )
    metrics = update_actor(
        model,
        optimizer,
        batch,
        old_log_probs=old,
        advantages=advantages,
        ref_log_probs=None,
        settings=settings,
        seed=0,
    )
    return metrics.mean_metrics()


@pytest.mark.parametrize("mode", MODES)
def test_actor_update_1x8_equals_4x2_micro_batches(tiny_model_dir, batch, mode):
    advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    base = load_actor(tiny_model_dir)
    one, four = copy.deepcopy(base), copy.deepcopy(base)
    m1 = _sgd_actor_step(one, batch, 8, mode, advantages)
    m4 = _sgd_actor_step(four, batch, 2, mode, advantages)
    for (name, p1), p4 in zip(one.named_parameters(), four.parameters(), strict=True):
        assert torch.allclose(p1, p4, atol=1e-6), name
    assert not torch.equal(next(one.parameters()), next(base.parameters()))
    for key in ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm"):
        assert m1[key] == pytest.approx(m4[key], abs=1e-5), key


@pytest.mark.parametrize("mode", MODES)
def test_critic_update_1x8_equals_4x2_micro_batches(tiny_model_dir, batch, mode):
    base = load_critic(tiny_model_dir)
    values = compute_values(base, batch, batching=8)
    returns = torch.randn(values.shape, generator=torch.Generator().manual_seed(1)) * batch.response_mask
    results = []
    for micro in (8, 2):
        critic = copy.deepcopy(base)
        optimizer = torch.optim.SGD(critic.parameters(), lr=0.1)
        settings = critic_settings(
            ppo_epochs=1, mini_batch_size=8, micro_batch_size=micro, loss_agg_mode=mode, grad_clip=1e9
        )
        metrics = update_critic(
            critic, optimizer, batch, values=values, returns=returns, settings=settings, seed=0
        ).mean_metrics()
        results.append((critic, metrics))
    (c1, m1), (c4, m4) = results
    for p1, p4 in zip(c1.parameters(), c4.parameters(), strict=True):
        assert torch.allclose(p1, p4, atol=1e-6)
    assert m1["critic/vf_loss"] == pytest.approx(m4["critic/vf_loss"], abs=1e-6)


def test_first_mini_batch_has_unit_ratio_and_metric_names(tiny_model_dir, batch):
    model = load_actor(tiny_model_dir)
    advantages = torch.ones(batch.response_mask.shape)
    metrics = _sgd_actor_step(model, batch, 4, "token-mean", advantages)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/pg_loss"] == pytest.approx(-1.0, abs=1e-5)  # −A·ρ with ρ = 1, A = 1
    assert set(metrics) == {
        "actor/pg_loss",
        "actor/entropy",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
        "actor/grad_norm",
        "actor/lr",
    }


def test_several_mini_batches_and_epochs_each_take_one_step(tiny_model_dir, batch):
    model = load_actor(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    old = compute_log_probs(model, batch, temperature=1.0, batching=8)
    settings = actor_settings(ppo_epochs=2, mini_batch_size=4, micro_batch_size=2, use_kl_loss=True)
    metrics = update_actor(
        model,
        optimizer,
        batch,
        old_log_probs=old,
        advantages=torch.ones_like(old),
        ref_log_probs=old,
        settings=settings,
        seed=0,
    )
    assert [(r["epoch"], r["mini_batch"]) for r in metrics.steps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    metrics = metrics.mean_metrics()
    assert optimizer.state[next(model.parameters())]["step"].item() == 4  # 2 epochs × 2 mini-batches
    assert metrics["actor/ppo_kl"] != 0.0 and metrics["actor/kl_loss"] > 0.0


def test_non_finite_gradient_skips_the_step(tiny_model_dir, batch):
    model = load_actor(tiny_model_dir)
    before = copy.deepcopy(model.state_dict())
    old = compute_log_probs(model, batch, temperature=1.0, batching=8)
    advantages = torch.full_like(old, float("nan"))
    metrics = update_actor(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        batch,
        old_log_probs=old,
        advantages=advantages,
        ref_log_probs=None,
        settings=actor_settings(ppo_epochs=1, mini_batch_size=8, micro_batch_size=8),
        seed=0,
    )
    metrics = metrics.mean_metrics()
    assert metrics["actor/grad_norm"] != metrics["actor/grad_norm"]  # NaN
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


def _count_saved(counts: list[int], tensor: torch.Tensor) -> torch.Tensor:
    counts.append(tensor.numel())
    return tensor


def test_gradient_checkpointing_changes_no_number_and_is_switched_off_after(tiny_model_dir, batch):
    """enable_gradient_checkpointing keeps only each layer's input for backward and recomputes the
    rest: far fewer saved activations, the same gradients and weights (bit for bit on one machine),
    and the model is left as it was."""
    advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(2))
    base = load_actor(tiny_model_dir)
    results = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        old = compute_log_probs(model, batch, temperature=1.0, batching=8)
        settings = actor_settings(micro_batch_size=4, gradient_checkpointing=checkpointing)
        saved = []
        count = functools.partial(_count_saved, saved)
        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            metrics = update_actor(
                model,
                optimizer,
                batch,
                old_log_probs=old,
                advantages=advantages,
                ref_log_probs=None,
                settings=settings,
                seed=0,
            )
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        results.append((model, metrics.mean_metrics(), sum(saved)))
    (plain, m_plain, saved_plain), (checkpointed, m_checkpointed, saved_checkpointed) = results
    assert saved_checkpointed < saved_plain / 3
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert m_plain == m_checkpointed
    assert not torch.equal(next(plain.parameters()), next(base.parameters()))


def test_without_an_entropy_bonus_the_entropy_is_a_metric_outside_the_graph_and_the_gradient_is_unchanged(
    tiny_model_dir, batch
):
    """entropy_coeff = 0: the update does not backpropagate through the (N, T, V) softmax of the
    entropy. The gradient is the one of pg_loss − 0·entropy, bit for bit, and the entropy metric
    is the same number."""
    from ppoflow.engine.forward import policy_forward
    from ppoflow.engine.masking import Aggregation, agg_loss
    from ppoflow.engine.policy_losses import ClipSettings, PolicyLossSpec, PolicyTokens, compute_policy_loss

    model = load_actor(tiny_model_dir)
    mask = batch.response_mask
    old = compute_log_probs(model, batch, temperature=1.0, batching=8)
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    grads, entropies = [], []
    for entropy_grad in (True, False):
        model.zero_grad()
        log_probs, entropy = policy_forward(
            model, batch, temperature=1.0, with_entropy=True, entropy_grad=entropy_grad
        )
        assert entropy.requires_grad is entropy_grad
        spec = PolicyLossSpec("vanilla", ClipSettings(0.2, 0.2, 3.0))
        agg = Aggregation("token-mean", tokens=float(mask.sum()))
        pg_loss, _ = compute_policy_loss(spec, PolicyTokens(old, log_probs, advantages, mask), agg)
        entropy_loss = agg_loss(entropy, mask, agg)
        (pg_loss - 0.0 * entropy_loss if entropy_grad else pg_loss).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        entropies.append(entropy_loss.item())
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert entropies[0] == entropies[1] > 0


def test_an_entropy_bonus_still_reaches_the_gradient(tiny_model_dir, batch):
    """entropy_coeff ≠ 0 backpropagates through the entropy: other weights than without it."""
    advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(2))
    base = load_actor(tiny_model_dir)
    trained = []
    for coeff in (0.0, 0.5):
        model = copy.deepcopy(base)
        _sgd_actor_step(model, batch, 8, "token-mean", advantages, entropy_coeff=coeff)
        trained.append(next(model.parameters()).detach().clone())
    assert not torch.equal(*trained)


@pytest.mark.parametrize("mode", MODES[:2])
def test_micro_batches_by_token_budget_give_the_update_of_fixed_ones(tiny_model_dir, batch, mode):
    """verl's use_dynamic_bsz: the loss is aggregated over the mini-batch, so only the grouping of the
    rows changes, and with it the float rounding (tolerance 1e-6, as for 1×8 vs 4×2)."""
    advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    base = load_actor(tiny_model_dir)
    fixed, budgeted = copy.deepcopy(base), copy.deepcopy(base)
    widest = int(batch.prompt_mask.sum(dim=1).max() + batch.response_mask.sum(dim=1).max())
    m_fixed = _sgd_actor_step(fixed, batch, 8, mode, advantages)
    budget = {"max_token_len": 3 * widest}  # several micro-batches of unequal sizes
    m_budget = _sgd_actor_step(budgeted, batch, 8, mode, advantages, **budget)
    for (name, p1), p2 in zip(fixed.named_parameters(), budgeted.parameters(), strict=True):
        assert torch.allclose(p1, p2, atol=1e-6), name
    for key in ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/grad_norm"):
        assert m_fixed[key] == pytest.approx(m_budget[key], abs=1e-5), key
    critic = load_critic(tiny_model_dir)
    values = compute_values(critic, batch, batching=8)
    returns = torch.randn(values.shape, generator=torch.Generator().manual_seed(1)) * batch.response_mask
    trained = []
    for extra in ({}, budget):
        model = copy.deepcopy(critic)
        settings = critic_settings(
            ppo_epochs=1, mini_batch_size=8, micro_batch_size=8, grad_clip=1e9, **extra
        )
        update_critic(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            batch,
            values=values,
            returns=returns,
            settings=settings,
            seed=0,
        )
        trained.append(model)
    for p1, p2 in zip(trained[0].parameters(), trained[1].parameters(), strict=True):
        assert torch.allclose(p1, p2, atol=1e-6)


class _BusierPeer(LocalStepper):
    """One process standing in for a rank whose peer needs more micro-batches: it agrees on two
    more than its own token budget gives (what a worker group's ranks do: the largest count)."""

    agreed: list[tuple[int, int]]

    def agree(self, count: int) -> int:
        self.agreed.append((count, count + 2))
        return count + 2


def test_a_rank_that_runs_more_micro_batches_than_its_budget_needs_gives_the_same_update(
    tiny_model_dir, batch
):
    advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(3))
    base = load_actor(tiny_model_dir)
    old = compute_log_probs(base, batch, temperature=1.0, batching=8)
    widest = int(batch.prompt_mask.sum(dim=1).max() + batch.response_mask.sum(dim=1).max())
    settings = actor_settings(
        ppo_epochs=1, mini_batch_size=8, micro_batch_size=8, grad_clip=1e9, max_token_len=4 * widest
    )
    models = []
    for stepper_class in (LocalStepper, _BusierPeer):
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        stepper = stepper_class(model, optimizer)
        stepper.agreed = []
        seen = []
        hook = model.register_forward_pre_hook(lambda *_, seen=seen: seen.append(1))
        update_actor(
            model, optimizer, batch, old_log_probs=old, advantages=advantages, ref_log_probs=None,
            settings=settings, seed=0, stepper=stepper,
        )  # fmt: skip
        hook.remove()
        models.append((model, len(seen), stepper.agreed))
    (plain, plain_passes, _), (busier, busier_passes, agreed) = models
    assert agreed and busier_passes == plain_passes + 2 == agreed[0][1]
    for a, b in zip(plain.parameters(), busier.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
