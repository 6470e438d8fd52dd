"""The reward model's score as a reward component: its weight beside the rule reward (or alone, as in
verl), the settings a run builds, inputs re-tokenised for a reward model with its own tokenizer, and
the reward model path checked when the config is loaded."""

from __future__ import annotations

import json
import shutil

import pytest

from ppoflow.conf import ConfigError, load_config
from ppoflow.engine.models import ModelLoadError, load_tokenizer
from ppoflow.engine.tiny import ADDITION_DATA_SOURCE
from ppoflow.tasks.pipeline.plan import reward_model_settings, reward_settings
from ppoflow.tasks.pipeline.settings import RewardSettings
from ppoflow.tasks.stages.reward_model import retokenised, same_tokenizer
from ppoflow.tasks.stages.rewards import remax_baselines, score_rows

from ...conf.micro import MICRO


def reward(rm_weight, rule_reward=True):
    return RewardSettings(
        weights={"correctness": 0.9, "format": 0.1},
        rm_weight=rm_weight,
        rule_reward=rule_reward,
        reward_fn_key="data_source",
        timeout_s=5.0,
        on_error="zero",
        gsm8k_method="strict",
        custom_function=None,
    )


def scored(responses, section, rm_scores, data_source=ADDITION_DATA_SOURCE):
    rows = [
        {"prompt_id": f"p{i}", "sample_idx": 0, "data_source": data_source, "response_text": text}
        for i, text in enumerate(responses)
    ]
    prompts = {r["prompt_id"]: {"ground_truth": "7", "extra_info": None} for r in rows}
    return score_rows(rows, prompts, section, rm_scores=rm_scores).to_pylist()


def test_the_reward_models_score_is_a_weighted_component_beside_the_rule_components():
    rows = scored(["7", "8", "x"], reward(rm_weight=2.0), rm_scores=[0.5, -1.25, 3.0])
    # 0.9·correctness + 0.1·format + 2·rm_score
    assert [r["score"] for r in rows] == pytest.approx([0.9 + 0.1 + 1.0, 0.1 - 2.5, 6.0])
    assert dict(rows[1]["components"]) == {"correctness": 0.0, "format": 1.0, "rm_score": -1.25}
    assert all(r["error"] is None for r in rows)


def test_without_an_rm_score_weight_the_score_is_the_reward_models_alone_as_in_verl():
    rows = scored(["7", "8"], reward(rm_weight=1.0, rule_reward=False), rm_scores=[0.5, -1.25])
    assert [r["score"] for r in rows] == [0.5, -1.25]
    assert [dict(r["components"]) for r in rows] == [{"rm_score": 0.5}, {"rm_score": -1.25}]
    # verl calls no rule function then: a data source without one is fine
    (row,) = scored(["7"], reward(1.0, rule_reward=False), rm_scores=[2.0], data_source="hh_rlhf")
    assert (row["score"], row["error"]) == (2.0, None)


def test_a_failing_rule_reward_counts_zero_and_keeps_its_error_beside_the_reward_model():
    (row,) = scored(["7"], reward(rm_weight=0.5), rm_scores=[4.0], data_source="hh_rlhf")
    assert row["score"] == 2.0 and "no built-in reward for data_source 'hh_rlhf'" in row["error"]
    assert dict(row["components"]) == {"rm_score": 4.0}


def test_remax_baselines_are_scored_with_the_reward_models_score_of_the_greedy_response():
    rows = [
        {"prompt_id": p, "sample_idx": i, "data_source": ADDITION_DATA_SOURCE, "response_text": "x"}
        | {"baseline_response_text": greedy}
        for p, greedy in (("a", "7"), ("b", "9"))
        for i in range(2)
    ]
    prompts = {p: {"ground_truth": "7", "extra_info": None} for p in ("a", "b")}
    baseline_rm = [1.5, 1.5, -0.5, -0.5]  # the reward model's score of each row's greedy response
    assert remax_baselines(rows, prompts, reward(rm_weight=2.0), baseline_rm) == pytest.approx(
        [1.0 + 3.0, 1.0 + 3.0, 0.1 - 1.0, 0.1 - 1.0]
    )
    assert remax_baselines(rows, prompts, reward(1.0, rule_reward=False), baseline_rm) == baseline_rm


def test_the_reward_section_splits_the_reward_models_weight_from_the_rule_weights(tmp_path):
    plain = reward_settings(load_config(None, ["reward.weights.correctness=0.8"], check_paths=False))
    assert (plain.weights, plain.rm_weight, plain.rule_reward) == (
        {"correctness": 0.8, "format": 0.1},
        None,
        True,
    )
    enabled = ["reward_model.enable=true", f"reward_model.model.path={tmp_path}"]
    alone = reward_settings(load_config(None, enabled, check_paths=False))
    assert (alone.weights, alone.rm_weight, alone.rule_reward) == (
        {"correctness": 0.9, "format": 0.1},  # what validation scores with: the rule reward, as verl
        1.0,
        False,
    )
    beside = reward_settings(load_config(None, [*enabled, "reward.weights.rm_score=0.5"], check_paths=False))
    assert (beside.weights, beside.rm_weight, beside.rule_reward) == (
        {"correctness": 0.9, "format": 0.1},
        0.5,
        True,
    )


@pytest.fixture
def reward_dir(tiny_model_dir, tmp_path):
    """A directory that looks like a reward model to the config check (a sequence classifier's
    config.json, safetensors, the tiny tokenizer)."""
    directory = tmp_path / "rm"
    shutil.copytree(tiny_model_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config |= {"architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "LABEL_0"}}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_reward_model_settings_name_its_files_by_digest_and_follow_the_log_prob_micro_batch(reward_dir):
    overrides = [*MICRO, "reward_model.enable=true", f"reward_model.model.path={reward_dir}"]
    settings = reward_model_settings(load_config(None, overrides))
    assert settings.path == str(reward_dir)
    assert settings.micro_batch_size == 8  # rollout.log_prob_micro_batch_size_per_gpu (MICRO)
    assert settings.max_length == 16 + 4  # the embedded default's prompt and response lengths
    (reward_dir / "config.json").write_text((reward_dir / "config.json").read_text() + "\n")  # any file
    assert reward_model_settings(load_config(None, overrides)).digest != settings.digest
    assert reward_model_settings(load_config(None, MICRO)) is None
    weights = (reward_dir / "model.safetensors").read_bytes()
    (reward_dir / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(
        ModelLoadError, match="\\(reward_model.model.path\\) cannot be loaded: model.safetensors is"
    ):
        reward_model_settings(load_config(None, overrides))  # at start, before the first step


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"architectures": ["Qwen2ForCausalLM"]}, "is not a sequence classifier: its config.json names"),
        ({"id2label": {"0": "a", "1": "b"}}, "with 2 labels; a reward model has one"),
    ],
)
def test_a_reward_model_path_that_is_not_one_is_refused_at_load_naming_the_key(reward_dir, edit, message):
    config = json.loads((reward_dir / "config.json").read_text()) | edit
    (reward_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(None, [*MICRO, "reward_model.enable=true", f"reward_model.model.path={reward_dir}"])
    assert "(reward_model.model.path)" in str(raised.value) and "command-line override #" in str(raised.value)


def test_a_missing_reward_model_path_or_one_without_weights_is_refused_at_load(reward_dir, tmp_path):
    with pytest.raises(
        ConfigError, match="model path '.*nowhere' \\(reward_model.model.path\\) does not exist"
    ):
        load_config(
            None, [*MICRO, "reward_model.enable=true", f"reward_model.model.path={tmp_path / 'nowhere'}"]
        )
    (reward_dir / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no \\*.safetensors weights"):
        load_config(None, [*MICRO, "reward_model.enable=true", f"reward_model.model.path={reward_dir}"])


def test_a_reward_model_with_its_own_tokenizer_reads_the_responses_re_tokenised(tiny_model_dir, tmp_path):
    actor = load_tokenizer(tiny_model_dir)
    own = load_tokenizer(tiny_model_dir)
    assert same_tokenizer(actor, own)
    own.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    assert not same_tokenizer(actor, own)
    rows = [
        {"prompt_id": "chat", "response_text": "12"},
        {"prompt_id": "text", "response_text": "7"},
        {"prompt_id": "long", "response_text": "123"},
    ]
    prompts = {
        "chat": {"prompt_messages": [{"role": "user", "content": "5 + 7"}], "prompt_text": None},
        "text": {"prompt_messages": None, "prompt_text": "3 + 4 = "},
        "long": {"prompt_messages": None, "prompt_text": "99 + 24 = "},
    }
    ids = retokenised(own, rows, prompts, max_length=10)
    assert [own.decode(i) for i in ids] == ["5 + 7=12=", "3 + 4 = 7", "99 + 24 = "]  # cut at 10 tokens
