"""The transformers rollout engine: determinism, log-probs, filters, stopping."""

import pytest
import torch

from ppoflow.engine import rollout
from ppoflow.engine.forward import compute_log_probs
from ppoflow.engine.models import load_actor, load_tokenizer
from ppoflow.engine.ppo import build_sequence_batch, pad_rows
from ppoflow.engine.rollout import (
    HFRolloutEngine,
    RowStreams,
    SamplingParams,
    filter_logits,
    left_pad,
    pad_flat,
    right_pad,
    sample_seed,
)
from ppoflow.engine.tiny import all_addition_problems

from .tiny_models import tiny_minimax


def _seeds(prompts, seed: int) -> list[int]:
    return [sample_seed(seed, i, 0) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    tokenizer, model = load_tokenizer(tiny_model_dir), load_actor(tiny_model_dir)
    engine = HFRolloutEngine(
        model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, batch_size=16
    )
    prompts = [tokenizer(p.prompt)["input_ids"] for p in all_addition_problems()[::3]]
    prompts[0] = tokenizer("12 + 3 = ")["input_ids"]  # a longer prompt forces left padding
    return tokenizer, model, engine, prompts


def test_same_seed_same_samples_different_seed_different(setup):
    _, _, engine, prompts = setup
    params = SamplingParams(max_new_tokens=4, temperature=1.5)
    a = engine.generate(prompts, params, seeds=_seeds(prompts, 7))
    b = engine.generate(prompts, params, seeds=_seeds(prompts, 7))
    c = engine.generate(prompts, params, seeds=_seeds(prompts, 8))
    assert a.response_ids == b.response_ids and a.rollout_log_probs == b.rollout_log_probs
    assert a.response_ids != c.response_ids


def test_rollout_log_probs_match_the_trainer_forward(setup):
    tokenizer, model, engine, prompts = setup
    params = SamplingParams(max_new_tokens=4, temperature=1.3)
    out = engine.generate(prompts, params, seeds=_seeds(prompts, 3))
    batch = build_sequence_batch(prompts, out.response_ids, pad_token_id=tokenizer.pad_token_id)
    old = compute_log_probs(model, batch, temperature=1.3, batching=7)
    rollout = pad_rows(out.rollout_log_probs, batch.response_ids.shape[1])
    assert torch.allclose(old, rollout, atol=1e-4)
    assert (old * batch.response_mask).abs().sum() > 0


def test_responses_stop_at_eos_and_report_finish_reason(setup):
    tokenizer, _, engine, prompts = setup
    out = engine.generate(
        prompts, SamplingParams(max_new_tokens=2, temperature=2.0), seeds=_seeds(prompts, 1)
    )
    eos = tokenizer.eos_token_id
    for ids, reason in zip(out.response_ids, out.finish_reasons, strict=True):
        assert 1 <= len(ids) <= 2
        assert eos not in ids[:-1]
        assert reason == ("stop" if ids[-1] == eos else "length")
    assert {"stop", "length"} == set(out.finish_reasons)


def test_greedy_is_argmax_and_batch_size_independent(setup):
    tokenizer, model, engine, prompts = setup
    greedy = SamplingParams.greedy(4)
    one_batch = HFRolloutEngine(
        model,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        batch_size=len(prompts),
    )
    assert (
        engine.generate(prompts, greedy, seeds=_seeds(prompts, 0)).response_ids
        == one_batch.generate(prompts, greedy, seeds=_seeds(prompts, 99)).response_ids
    )


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [[False, False, True, True]]
    # probabilities ≈ [0.644, 0.237, 0.087, 0.032]: top_p=0.8 keeps the first two tokens
    assert torch.isinf(filter_logits(logits, top_k=-1, top_p=0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_k=-1, top_p=0.5)).tolist() == [[False, True, True, True]]
    assert not torch.isinf(filter_logits(logits, top_k=0, top_p=1.0)).any()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(("vocab", "budget"), [(7, 1 << 24), (7, 1), (49_152, 3 * 49_152 * 5)])
def test_batched_sampling_draws_what_torch_multinomial_draws_row_by_row(vocab, budget, threads, monkeypatch):
    """Each row's token at each step is the one `torch.multinomial(p, 1, generator)` picks from the
    row's own stream, whether the noise of all steps is drawn at once, one step at a time (budget
    1) or a few steps at a time, by one thread or by several; with top-k/top-p zeros in the
    probabilities too."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the draw's thread count
    monkeypatch.setattr(rollout, "NOISE_PER_THREAD", 1)  # threads even for these small draws
    torch.manual_seed(0)
    seeds, steps = [sample_seed(3, i, 0) for i in range(3)], 12
    probs = [torch.softmax(torch.randn(3, vocab) * 3, dim=-1) for _ in range(steps)]
    probs[1][:, 1:] = 0.0  # a filtered row keeps one token
    probs[1][:, 0] = 1.0
    reference = [torch.Generator().manual_seed(s) for s in seeds]
    expected = [
        [int(torch.multinomial(row, 1, generator=g)) for row, g in zip(p, reference, strict=True)]
        for p in probs
    ]
    streams = RowStreams(seeds, budget=budget)
    drawn = [streams.sample(p, steps_left=steps - step).tolist() for step, p in enumerate(probs)]
    assert drawn == expected
    assert drawn[1] == [0, 0, 0]


def test_batched_sampling_refuses_probabilities_that_multinomial_refuses():
    streams = RowStreams([1, 2])
    with pytest.raises(ValueError, match="inf, nan or a negative"):
        streams.sample(torch.tensor([[0.5, float("nan")], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="2 random streams"):
        streams.sample(torch.tensor([[0.5, 0.5]]))


def test_top_k_one_sampling_equals_greedy(setup):
    _, _, engine, prompts = setup
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=4, top_k=1), seeds=_seeds(prompts, 5))
    greedy = engine.generate(prompts, SamplingParams.greedy(4), seeds=_seeds(prompts, 5))
    assert sampled.response_ids == greedy.response_ids


def test_progress_counts_every_generated_token_and_every_finished_response(setup):
    """on_tokens adds up to the responses' lengths (EOS included, padding after it not); on_batch to
    the number of responses, one call per generation batch (16 here)."""
    _, _, engine, prompts = setup
    tokens, batches = [], []
    out = engine.generate(
        prompts,
        SamplingParams(max_new_tokens=3, temperature=2.0),
        seeds=_seeds(prompts, 5),
        on_batch=batches.append,
        on_tokens=tokens.append,
    )
    assert sum(tokens) == sum(len(ids) for ids in out.response_ids) > len(prompts)
    assert batches == [len(prompts[i : i + 16]) for i in range(0, len(prompts), 16)]


def test_a_response_does_not_depend_on_its_batch(setup):
    """Each response samples from its own stream: generating the prompts in two halves (two devices'
    shares) gives the same responses, token for token, as one call over all of them, when the
    generation batches have the same shapes (batch_size 16 here, halves of 16 prompts)."""
    tokenizer, model, engine, prompts = setup
    prompts = prompts[:32]
    seeds = _seeds(prompts, 11)
    params = SamplingParams(max_new_tokens=4, temperature=1.5)
    whole = engine.generate(prompts, params, seeds=seeds)
    halves = [engine.generate(prompts[i : i + 16], params, seeds=seeds[i : i + 16]) for i in (0, 16)]
    assert whole.response_ids == halves[0].response_ids + halves[1].response_ids
    assert whole.rollout_log_probs == halves[0].rollout_log_probs + halves[1].rollout_log_probs
    reordered = engine.generate(prompts[::-1], params, seeds=seeds[::-1])  # other batch companions
    assert len(set(map(tuple, whole.response_ids))) > 1
    same = sum(a == b for a, b in zip(whole.response_ids, reordered.response_ids[::-1], strict=True))
    assert same >= len(prompts) - 2  # only padding-width numerics can flip a near-tie


def test_the_responses_of_a_prompt_share_its_prefill_and_sample_what_a_prefill_per_row_samples(
    setup, monkeypatch
):
    """n responses per prompt (rollout.n): the prompts' forward pass runs once per distinct prompt
    and its KV cache is given to each of its rows; the responses and their log-probs are those of a
    prefill per row (float32, within 1e-5: the smaller batch may round differently)."""
    _, model, engine, prompts = setup
    prompts = [p for p in prompts[:6] for _ in range(4)]  # 6 prompts, the longest first, 4 samples each
    seeds = [sample_seed(5, i // 4, i % 4) for i in range(len(prompts))]
    params = SamplingParams(max_new_tokens=4, temperature=1.5)
    widths = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        shared = engine.generate(prompts, params, seeds=seeds)
        first_calls = widths[:2]
        monkeypatch.setattr(rollout, "_distinct_prompts", lambda prompts: None)
        widths.clear()
        each = engine.generate(prompts, params, seeds=seeds)
    finally:
        hook.remove()
    longest = max(map(len, prompts))
    assert first_calls == [(4, longest), (16, 1)]  # generation batches of 16 rows: 4 prompts first
    assert widths[0] == (16, longest)
    assert shared.response_ids == each.response_ids
    assert len(set(map(tuple, shared.response_ids))) > 6  # the samples of a prompt differ
    for a, b in zip(shared.rollout_log_probs, each.rollout_log_probs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_a_cache_with_state_outside_its_layers_is_not_shared_but_prefilled_per_row(monkeypatch):
    """MiniMax's cache keeps its linear-attention states beside the layers that `reorder_cache`
    indexes: its prompts are prefilled row by row (from the first batch on), as before sharing."""
    model = tiny_minimax()
    prompts = [[5, 6, 7, 8]] * 3 + [[9, 10, 11]] * 3
    params = SamplingParams(max_new_tokens=5, temperature=1.5)

    def generate():
        engine = HFRolloutEngine(model, eos_token_ids=[1], pad_token_id=0, batch_size=8)
        return engine, engine.generate(prompts, params, seeds=list(range(6)))

    engine, first = generate()
    assert not engine._shares_prefill
    again = engine.generate(prompts, params, seeds=list(range(6)))
    monkeypatch.setattr(rollout, "_distinct_prompts", lambda prompts: None)
    _, per_row = generate()
    assert first.response_ids == again.response_ids == per_row.response_ids
    assert first.rollout_log_probs == again.rollout_log_probs == per_row.rollout_log_probs


def test_distinct_prompts_name_each_prompt_by_its_first_row():
    assert rollout._distinct_prompts([[1, 2], [3], [1, 2], [3], [4]]) == ([0, 1, 4], [0, 1, 0, 1, 2])
    assert rollout._distinct_prompts([[1, 2], [3], [2, 1]]) is None  # no two rows share a prompt
    assert rollout._distinct_prompts([]) is None


def test_one_seed_per_response_is_required(setup):
    _, _, engine, prompts = setup
    with pytest.raises(ValueError, match="one seed per response"):
        engine.generate(prompts, SamplingParams(max_new_tokens=2), seeds=[1])


def test_padding_places_each_row_at_its_side_and_refuses_a_row_longer_than_the_width():
    ids, mask = left_pad([[5, 6], [7], [8, 9, 4]], pad_id=0)
    assert ids.tolist() == [[0, 5, 6], [0, 0, 7], [8, 9, 4]]
    assert mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1]] and mask.dtype == torch.long
    values, mask = right_pad([[0.5], [], [0.25, -1.0]], 0.0, width=3, dtype=torch.float32)
    assert values.tolist() == [[0.5, 0, 0], [0, 0, 0], [0.25, -1.0, 0]]
    assert mask.tolist() == [[1, 0, 0], [0, 0, 0], [1, 1, 0]] and mask.dtype == torch.float32
    flat, lengths = torch.tensor([1, 2, 3]), torch.tensor([2, 1])
    assert pad_flat(flat, lengths, 2, -1, left=True)[0].tolist() == [[1, 2], [-1, 3]]
    with pytest.raises(ValueError, match="a row of 3 values does not fit in width 2"):
        right_pad([[1, 2, 3]], 0, width=2)
