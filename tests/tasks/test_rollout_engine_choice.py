"""actor_rollout_ref.rollout.name selects the rollout engine; an unavailable one is a clear error."""

import pytest

from ppoflow.tasks.models.generation import rollout_engine


def test_unavailable_engine_is_a_clear_error_not_a_silent_fallback():
    with pytest.raises(
        NotImplementedError, match="rollout.name=vllm: .*use actor_rollout_ref.rollout.name=hf"
    ):
        rollout_engine("vllm", model=None, tokenizer=None)
