"""verl's GSM8K multi-turn tool example in ppoflow's form (conf/gsm8k_tool_smollm2.yaml) with the real
SmolLM2-135M-Instruct on CPU: the model calls verl's calc_gsm8k_reward tool in the hermes format, and
the turns table holds each call, its result and reward, the tool turn rendered by SmolLM2's chat
template. The rollouts of one step, 16 responses: with the data's worked example in the prompt,
about a third of SmolLM2's answers write a call (0 of 16 would happen about once in a thousand runs),
some of them malformed or to a tool that does not exist, each an error row."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppoflow.tasks.storage.confined_query import query

CONFIG = Path(__file__).resolve().parents[2] / "conf/gsm8k_tool_smollm2.yaml"


@pytest.mark.slow
def test_smollm2_calls_the_gsm8k_tool_and_each_call_is_a_row(prefect_server, tmp_path):
    from ppoflow.flows.train import ppo_train

    ppo_train(
        str(CONFIG),
        [
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
            "trainer.total_training_steps=1",
            "trainer.critic_warmup=2",  # the rollouts are the subject: no actor update (verl's warm-up)
            "actor_rollout_ref.actor.use_kl_loss=false",  # nor a reference pass
            "algorithm.rollout_correction.bypass_mode=true",  # nor a recomputation of the log-probs
            "trainer.test_freq=-1",
            "trainer.num_threads=2",
            f"trainer.default_local_dir={tmp_path}",
        ],
    )
    columns, rows = query(
        tmp_path,
        "SELECT t.tool_name, t.result, t.error, t.tool_reward, t.text, r.tool_reward AS total, "
        "r.response_ids[t.token_start + 1 : t.token_end] AS ids, r.response_mask, t.token_start, t.token_end "
        "FROM turns t JOIN rollouts r USING (iter, prompt_id, sample_idx) WHERE t.role = 'tool'",
    )
    calls = [dict(zip(columns, row, strict=True)) for row in rows]
    assert calls, "no tool call in 16 responses"
    from ppoflow.engine.models import load_tokenizer
    from ppoflow.tasks.stages.prepare_model import converted_gguf, smollm2_gguf

    tokenizer = load_tokenizer(converted_gguf(smollm2_gguf()))
    for call in calls:
        if call["error"] is None:  # verl's GSM8K tool scored the answer
            assert call["tool_name"] == "calc_gsm8k_reward" and call["result"].startswith(
                "Current parsed answer="
            )
            assert call["tool_reward"] in (0.0, -0.05)
        else:  # malformed, or a tool that does not exist: the model reads why
            assert call["text"].startswith("Error") and call["tool_reward"] is None
        if call["token_end"] > call["token_start"]:  # read by the model: SmolLM2's template around it
            text = tokenizer.decode(call["ids"])
            assert text == f"<|im_start|>tool\n{call['text']}<|im_end|>\n<|im_start|>assistant\n"
            assert set(call["response_mask"][call["token_start"] : call["token_end"]]) == {0}
    per_response = query(
        tmp_path,
        "SELECT r.tool_reward, coalesce(sum(t.tool_reward), 0) FROM rollouts r LEFT JOIN turns t "
        "ON t.iter = r.iter AND t.prompt_id = r.prompt_id AND t.sample_idx = r.sample_idx "
        "AND t.role = 'tool' "
        "GROUP BY r.iter, r.prompt_id, r.sample_idx, r.tool_reward",
    )[1]
    assert len(per_response) == 16 and all(total == summed for total, summed in per_response)
    components = query(tmp_path, "SELECT DISTINCT map_keys(components) FROM rewards")[1]
    assert all("tool" in keys for (keys,) in components)
