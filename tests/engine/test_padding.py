"""Micro-batches leave out the columns that are padding in all of their rows: the model sees each
micro-batch at its own width, and log-probs, values and updates are those of the padded batch
(float32, within 1e-6: shorter shapes may round differently)."""

import copy

import pytest
import torch

from ppoflow.engine.forward import SequenceBatch, compute_log_probs, compute_values
from ppoflow.engine.models import load_actor, load_critic
from ppoflow.engine.ppo import build_sequence_batch
from ppoflow.engine.update import update_actor, update_critic

from .settings import actor_settings, critic_settings

# rows 0-1: short prompts and responses; rows 2-3: the batch's longest prompt and response
PROMPTS = [[5, 6], [7, 8, 9], [5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
RESPONSES = [[11, 1], [14], [16, 17, 18, 19, 1], [17, 18, 1]]


def _widths(model) -> list[int]:
    """input_ids widths of every forward call of `model` from now on."""
    seen: list[int] = []
    model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    return seen


def _padded(batch: SequenceBatch, left: int, right: int) -> SequenceBatch:
    """`batch` with `left` more pad columns before the prompts and `right` more after the responses."""
    n = len(batch)
    zeros = lambda width, like: torch.zeros(n, width, dtype=like.dtype)  # noqa: E731
    return SequenceBatch(
        torch.cat([zeros(left, batch.prompt_ids), batch.prompt_ids], dim=1),
        torch.cat([zeros(left, batch.prompt_mask), batch.prompt_mask], dim=1),
        torch.cat([batch.response_ids, zeros(right, batch.response_ids)], dim=1),
        torch.cat([batch.response_mask, zeros(right, batch.response_mask)], dim=1),
    )


def test_without_padding_keeps_the_columns_some_row_uses():
    batch = build_sequence_batch(PROMPTS, RESPONSES, pad_token_id=0)
    assert batch.prompt_ids.shape == (4, 7) and batch.response_ids.shape == (4, 5)
    short = batch.select(slice(0, 2)).without_padding()
    assert short.prompt_ids.tolist() == [[0, 5, 6], [7, 8, 9]]
    assert short.prompt_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert short.response_ids.tolist() == [[11, 1], [14, 0]]
    assert short.response_mask.tolist() == [[1, 1], [1, 0]]
    assert batch.without_padding() is batch  # every column is some row's
    # a side without any valid token is kept whole
    empty = SequenceBatch(
        batch.prompt_ids[:2], batch.prompt_mask[:2], torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3)
    )
    assert empty.without_padding().response_ids.shape == (2, 3)
    assert empty.without_padding().prompt_ids.shape == (2, 3)


def test_each_micro_batch_runs_at_its_own_width_with_the_same_log_probs_and_values(tiny_model_dir):
    batch = build_sequence_batch(PROMPTS, RESPONSES, pad_token_id=0)
    actor, critic = load_actor(tiny_model_dir), load_critic(tiny_model_dir)
    whole = compute_log_probs(actor, batch, temperature=1.0, batching=4)
    widths = _widths(actor)
    split = compute_log_probs(actor, batch, temperature=1.0, batching=2)
    assert widths == [3 + 2, 7 + 5]  # rows 0-1: prompt 3, response 2; rows 2-3: the whole width
    assert split.shape == whole.shape
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-6)
    assert torch.all(split[batch.response_mask == 0] == 0)
    wide = _padded(batch, left=5, right=3)
    torch.testing.assert_close(
        compute_log_probs(actor, wide, temperature=1.0, batching=4)[:, :5], whole, rtol=0, atol=1e-6
    )
    values = compute_values(critic, batch, batching=4)
    torch.testing.assert_close(compute_values(critic, batch, batching=2), values, rtol=0, atol=1e-6)
    torch.testing.assert_close(compute_values(critic, wide, batching=1)[:, :5], values, rtol=0, atol=1e-6)


def test_updates_without_padding_columns_equal_updates_with_them(tiny_model_dir, monkeypatch):
    """Micro-batches of 2 rows trimmed (rows 0-1 to 5 of 12 columns) against the same micro-batches
    at the batch's width: every parameter within 1e-6 absolute or 1e-5 relative after two epochs of
    SGD (token-mean; an embedding entry of 1.4 ends 1.4e-6 apart, its float32 rounding), the
    metrics within 1e-5, absolute or relative (ppo_kl is a mean of differences of nearly equal
    log-probs; grad_norm a sum over every parameter). AdamW would turn the rounding differences of
    parameters whose gradient is about 0 into steps of the learning rate: its first steps are
    sign-like."""
    batch = build_sequence_batch(PROMPTS, RESPONSES, pad_token_id=0)
    generator = torch.Generator().manual_seed(0)
    advantages = torch.randn(batch.response_mask.shape, generator=generator) * batch.response_mask
    returns = torch.randn(batch.response_mask.shape, generator=generator) * batch.response_mask
    actor_base, critic_base = load_actor(tiny_model_dir), load_critic(tiny_model_dir)
    old = compute_log_probs(actor_base, batch, temperature=1.0, batching=4)
    values = compute_values(critic_base, batch, batching=4)
    actors, critics, metrics, widths = [], [], [], []
    for trimmed in (True, False):
        if not trimmed:
            monkeypatch.setattr(SequenceBatch, "without_padding", lambda batch: batch)
        actor, critic = copy.deepcopy(actor_base), copy.deepcopy(critic_base)
        widths.append(_widths(actor))
        result = update_actor(
            actor,
            torch.optim.SGD(actor.parameters(), lr=0.1),
            batch,
            old_log_probs=old,
            advantages=advantages,
            ref_log_probs=None,
            settings=actor_settings(ppo_epochs=2, mini_batch_size=4, micro_batch_size=2, grad_clip=1e9),
            seed=0,
        ).mean_metrics()
        critic_result = update_critic(
            critic,
            torch.optim.SGD(critic.parameters(), lr=0.1),
            batch,
            values=values,
            returns=returns,
            settings=critic_settings(ppo_epochs=2, mini_batch_size=4, micro_batch_size=2, grad_clip=1e9),
            seed=0,
        ).mean_metrics()
        actors.append(actor)
        critics.append(critic)
        metrics.append(result | critic_result)
    assert widths == [[5, 12] * 2, [12, 12] * 2]  # two epochs of two micro-batches
    for first, second in ((actors[0], actors[1]), (critics[0], critics[1])):
        for (name, a), b in zip(first.named_parameters(), second.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(next(actors[0].parameters()), next(actor_base.parameters()))
    for key in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm", "critic/vf_loss"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=1e-5), key
