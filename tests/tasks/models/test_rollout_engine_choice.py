"""actor_rollout_ref.rollout.name selects the rollout engine of a process (RolloutEngines)."""

import pytest

from ppoflow.engine.batching import ForwardBatching
from ppoflow.engine.rollout import HFRolloutEngine, SamplingParams
from ppoflow.tasks.models.generation import RolloutEngines, rollout_share
from ppoflow.tasks.pipeline.placement import RolloutRequest


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from ppoflow.engine.models import load_actor, load_tokenizer

    return load_actor(tiny_model_dir), load_tokenizer(tiny_model_dir)


def test_hf_engine_generates_with_the_given_actor_and_its_eos_ids(tiny, tiny_model_dir):
    actor, tokenizer = tiny
    engine = RolloutEngines().engine(
        "hf", actor, tokenizer, batch_size=3, vllm=None, model_dir=str(tiny_model_dir), version="a"
    )
    assert isinstance(engine, HFRolloutEngine)
    assert engine.model is actor and engine.batch_size == 3
    assert engine.eos_token_ids.tolist() == [tokenizer.eos_token_id]
    out = engine.generate([[5, 6, 7]] * 2, SamplingParams(max_new_tokens=3), seeds=[1, 2])
    assert len(out.response_ids) == 2 and all(1 <= len(ids) <= 3 for ids in out.response_ids)


def test_vllm_without_its_options_is_a_clear_error(tiny, tiny_model_dir):
    actor, tokenizer = tiny
    with pytest.raises(ValueError, match="rollout.name=vllm needs the engine's options"):
        RolloutEngines().engine(
            "vllm", actor, tokenizer, batch_size=3, vllm=None, model_dir=str(tiny_model_dir), version="a"
        )


def test_a_rank_without_prompts_returns_empty_shares(tiny):
    """A worker group with more ranks than a step's prompts: the idle ranks' shares are empty,
    with the columns the joined table expects (no engine is started for them)."""
    actor, tokenizer = tiny
    request = RolloutRequest(
        "hf",
        2,
        SamplingParams(max_new_tokens=4),
        seed=1,
        generation_batch_size=8,
        log_prob_batching=ForwardBatching(8),
        ref_log_prob_batching=ForwardBatching(8),
    )
    share = rollout_share(None, actor, actor, tokenizer, [], request, first_prompt=1)
    assert share.response_ids == [] and share.ref_log_probs == [] and share.old_log_probs == []
    assert rollout_share(None, actor, None, tokenizer, [], request).ref_log_probs is None
