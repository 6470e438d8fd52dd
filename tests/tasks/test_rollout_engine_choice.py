"""actor_rollout_ref.rollout.name selects the rollout engine; an unavailable one is a clear error."""

import pytest

from ppoflow.tasks.models.generation import rollout_engine


def test_unavailable_engine_is_a_clear_error_not_a_silent_fallback():
    with pytest.raises(
        NotImplementedError, match="rollout.name=vllm: .*use actor_rollout_ref.rollout.name=hf"
    ):
        rollout_engine("vllm", model=None, tokenizer=None)


def test_a_rank_without_prompts_returns_empty_shares(tiny_model_dir):
    """A worker group with more ranks than a step's (or validation's) prompts: the idle ranks'
    shares are empty, with the columns the joined table expects."""
    from ppoflow.engine.models import load_actor, load_tokenizer
    from ppoflow.engine.rollout import SamplingParams
    from ppoflow.tasks.models.generation import RolloutRequest, generate_share, rollout_share

    actor, tokenizer = load_actor(tiny_model_dir), load_tokenizer(tiny_model_dir)
    sampling = SamplingParams(max_new_tokens=4)
    request = RolloutRequest(
        "hf",
        2,
        sampling,
        seed=1,
        generation_batch_size=8,
        log_prob_micro_batch_size=8,
        ref_log_prob_micro_batch_size=8,
    )
    share = rollout_share(actor, actor, tokenizer, [], request, first_prompt=1)
    assert share.response_ids == [] and share.ref_log_probs == [] and share.old_log_probs == []
    assert rollout_share(actor, None, tokenizer, [], request).ref_log_probs is None
    assert generate_share(actor, tokenizer, [], sampling, [], engine="hf", batch_size=8).response_ids == []
