"""The vLLM rollout engine on a real GPU (marked `gpu`: skipped without a CUDA device).

Run on a GPU machine set up with `bash scripts/setup --gpu`: `pytest -m gpu`. The engine serves the
tiny model in float32, so its log-probs can be compared with the trainer's to a tight tolerance. The
module's engine is shut down before tests/gpu/test_vllm_training.py starts the runs' own engines."""

from __future__ import annotations

import pytest
import torch

from ppoflow.engine.forward import compute_log_probs
from ppoflow.engine.models import load_actor, load_tokenizer
from ppoflow.engine.ppo import build_sequence_batch, unpad
from ppoflow.engine.rollout import SamplingParams
from ppoflow.engine.vllm_rollout import VLLMOptions, VLLMRolloutEngine

pytestmark = pytest.mark.gpu

FP32_LOG_PROB_TOLERANCE = 2e-3
"""|vLLM's log-prob − the trainer's| per token, both float32 on one GPU (different kernels:
paged attention vs a full forward pass)."""


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    pytest.importorskip("vllm", reason="needs vLLM (bash scripts/setup --gpu)")
    tokenizer = load_tokenizer(tiny_model_dir)
    options = VLLMOptions("float32", 64, gpu_memory_utilization=0.2, free_cache_engine=True)
    vllm_engine = VLLMRolloutEngine(tiny_model_dir, options, eos_token_ids=[tokenizer.eos_token_id])
    yield vllm_engine
    vllm_engine.close()


def _prompts(tokenizer, n):
    texts = [f"{a}+{b}=" for a, b in [(3, 4), (12, 30), (7, 7), (45, 9)]]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts][:n]


def _trainer_log_probs(actor, prompts, out, pad_id, temperature):
    batch = build_sequence_batch(prompts, out.response_ids, pad_token_id=pad_id)
    log_probs = compute_log_probs(actor, batch, temperature=temperature, batching=64)
    return unpad(log_probs, batch.response_mask)


def _largest_gap(rows, reference_rows) -> float:
    return max(
        abs(a - b)
        for row, reference in zip(rows, reference_rows, strict=True)
        for a, b in zip(row, reference, strict=True)
    )


def test_generates_what_the_synced_actor_would_and_follows_each_sync(engine, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    actor = load_actor(tiny_model_dir).cuda()
    prompts = [p for p in _prompts(tokenizer, 4) for _ in range(4)]
    seeds = list(range(100, 100 + len(prompts)))
    params = SamplingParams(8, temperature=0.8)

    engine.load_weights(actor.state_dict().items(), version="base")
    first = engine.generate(prompts, params, seeds=seeds)
    for ids, reason in zip(first.response_ids, first.finish_reasons, strict=True):
        assert (ids[-1] == tokenizer.eos_token_id) == (reason == "stop")  # EOS is part of the response
    trainer = _trainer_log_probs(actor, prompts, first, tokenizer.pad_token_id, 0.8)
    assert _largest_gap(first.rollout_log_probs, trainer) < FP32_LOG_PROB_TOLERANCE

    # free_cache_engine released the weights; the same state synced again samples the same tokens
    engine.load_weights(actor.state_dict().items(), version="base")
    assert engine.generate(prompts, params, seeds=seeds).response_ids == first.response_ids

    # a changed actor is what the engine generates with after the next sync, not a restart
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(actor.state_dict().items(), version="changed")
    changed = engine.generate(prompts, params, seeds=seeds)
    trainer = _trainer_log_probs(actor, prompts, changed, tokenizer.pad_token_id, 0.8)
    assert _largest_gap(changed.rollout_log_probs, trainer) < FP32_LOG_PROB_TOLERANCE
    assert changed.rollout_log_probs != first.rollout_log_probs


def test_generate_without_synced_weights_is_refused(engine):
    """A fresh engine, or one whose weights free_cache_engine released after generating."""
    with pytest.raises(RuntimeError, match="has no actor weights"):
        engine.generate([[5, 6]], SamplingParams(2), seeds=[1])
