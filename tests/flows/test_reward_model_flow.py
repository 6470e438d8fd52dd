"""A learned reward model in a run: ppoflow trains one on labelled answers to the addition task, it
separates held-out right from wrong answers, and a two-step run scores every response with it as the
component rm_score, cached, resumed after a kill, and recomputed when its weights change."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification

from ppoflow.engine.forward import compute_scores
from ppoflow.engine.models import load_reward_model, load_tokenizer
from ppoflow.engine.ppo import build_sequence_batch
from ppoflow.engine.reward_model import separation_auc
from ppoflow.engine.rewards import addition_components
from ppoflow.engine.tiny import labelled_addition_responses
from ppoflow.reward_model_command import RewardModelRecipe, train_reward_model_dir
from ppoflow.tasks.storage.catalog import check_invariants, refresh_catalog
from ppoflow.tasks.storage.confined_query import query
from ppoflow.tasks.storage.manifests import read_manifest

from .conftest import SMALL, train
from .test_metrics_sql import assert_metrics_match_rows
from .test_train_flow import task_states

RM_WEIGHT = 0.5
THREADS = "trainer.num_threads=1"


def with_reward_model(path) -> list[str]:
    return [
        "reward_model.enable=true",
        f"reward_model.model.path={path}",
        f"reward.weights.rm_score={RM_WEIGHT}",
    ]


@pytest.fixture(scope="module")
def reward_dir(tiny_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("rm") / "addition-rm"
    report = train_reward_model_dir(directory, RewardModelRecipe(steps=200))
    assert report["loss_last"] < report["loss_first"]
    return directory


@pytest.fixture(scope="module")
def rm_run(prefect_server, reward_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rm-run")
    summary, flow_run_id = train(run_dir, *with_reward_model(reward_dir), THREADS)
    return run_dir, summary, flow_run_id


def rows(run_dir, sql):
    columns, values = query(run_dir, sql)
    return [dict(zip(columns, row, strict=True)) for row in values]


def test_the_trained_reward_model_separates_held_out_right_and_wrong_answers(reward_dir):
    tokenizer, model = load_tokenizer(reward_dir), load_reward_model(reward_dir)
    records = labelled_addition_responses(300, seed=99)  # not the data it was trained on (seeds 1, 2)
    eos = {"stop": [tokenizer.eos_token_id], "length": []}
    batch = build_sequence_batch(
        [tokenizer(r["prompt"])["input_ids"] for r in records],
        [tokenizer(r["response"])["input_ids"] + eos[r["finish_reason"]] for r in records],
        pad_token_id=tokenizer.pad_token_id,
    )
    labels = torch.tensor([r["label"] for r in records])
    scores = compute_scores(model, batch, micro_batch_size=64)
    assert separation_auc(scores, labels) > 0.75
    assert scores[labels == 1].mean() - scores[labels == 0].mean() > 0.5


def test_every_response_is_scored_by_the_reward_model_and_weighed_into_the_score(rm_run, reward_dir):
    run_dir, _, _ = rm_run
    scored = rows(
        run_dir,
        "SELECT r.iter, r.prompt_id, r.sample_idx, o.prompt_ids, o.response_ids, m.rm_score, m.input_length, "
        "r.score, r.components FROM rewards r JOIN reward_model m USING (iter, prompt_id, sample_idx) "
        "JOIN rollouts o USING (iter, prompt_id, sample_idx) ORDER BY r.iter, r.prompt_id, r.sample_idx",
    )
    assert len(scored) == 2 * 32 == rows(run_dir, "SELECT count(*) AS n FROM rewards")[0]["n"]
    # the reward model's own forward (transformers' pooling), one unpadded response at a time
    plain = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    with torch.no_grad():
        own = [plain(torch.tensor([r["prompt_ids"] + r["response_ids"]])).logits.item() for r in scored]
    torch.testing.assert_close(
        torch.tensor([r["rm_score"] for r in scored]), torch.tensor(own), rtol=1e-5, atol=1e-5
    )
    for r in scored:
        c = r["components"]
        assert c["rm_score"] == r["rm_score"]
        assert r["input_length"] == len(r["prompt_ids"]) + len(r["response_ids"])
        expected = 0.9 * c["correctness"] + 0.1 * c["format"] + RM_WEIGHT * c["rm_score"]
        assert r["score"] == pytest.approx(expected, abs=1e-12)
    # That the scores separate right answers from wrong ones is checked on 300 held-out responses
    # (test_the_trained_reward_model_separates_held_out_right_and_wrong_answers): on a run's 32
    # samples a step it depends on the CPU (on an AMD EPYC, step 1's wrong answers scored higher).
    assert check_invariants(run_dir) == {}


def test_metrics_keep_verls_names_and_the_reward_timer_covers_both_stages(rm_run):
    run_dir, _, _ = rm_run
    assert_metrics_match_rows(run_dir)  # every metric, recomputed with SQL from the rows
    for step in (1, 2):
        (metrics,) = rows(
            run_dir, f'SELECT "critic/score/mean", "timing_s/reward" FROM metrics WHERE iter = {step}'
        )
        (mean,) = rows(run_dir, f"SELECT avg(score) AS s FROM rewards WHERE iter = {step}")
        assert metrics["critic/score/mean"] == pytest.approx(mean["s"], abs=1e-12)
        stages = read_manifest(run_dir, step)["stages"]
        timers = stages["reward_model"]["timers"]["reward"] + stages["rewards"]["timers"]["reward"]
        assert metrics["timing_s/reward"] == pytest.approx(timers, rel=1e-12)


def test_a_rerun_is_served_from_cache_and_new_weights_are_scored_again(rm_run, reward_dir, tmp_path):
    run_dir, summary, first_id = rm_run
    again, second_id = train(run_dir, *with_reward_model(reward_dir), THREADS)
    first = task_states(first_id)
    assert "reward_model-step2" in first
    assert set(task_states(second_id, expected=len(first)).values()) == {"Cached"}
    assert again["val_scores"] == summary["val_scores"]
    # the same run with the reward model's score head doubled, in place: step 1 is scored again
    copy, model = tmp_path / "run", tmp_path / "rm"
    shutil.copytree(run_dir, copy)
    refresh_catalog(copy)  # its views name the run's folder
    shutil.copytree(reward_dir, model)
    weights = load_file(model / "model.safetensors")
    weights["score.weight"] = weights["score.weight"] * 2
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    before = rows(
        copy, "SELECT prompt_id, sample_idx, rm_score FROM reward_model WHERE iter = 1 ORDER BY ALL"
    )
    _, third_id = train(copy, *with_reward_model(model), THREADS, "trainer.total_training_steps=1")
    states = task_states(third_id)
    assert (states["rollouts-step1"], states["reward_model-step1"], states["rewards-step1"]) == (
        "Cached",
        "Completed",
        "Completed",
    )
    after = rows(copy, "SELECT prompt_id, sample_idx, rm_score FROM reward_model WHERE iter = 1 ORDER BY ALL")
    assert [r["rm_score"] for r in after] == [2 * r["rm_score"] for r in before]  # ×2 is exact


def test_a_kill_inside_the_reward_model_stage_resumes_there(rm_run, reward_dir, tmp_path):
    """`ppoflow train` SIGKILLed inside the reward_model stage of step 1, then the same run again:
    the rollouts are not generated again, and it ends with the tables of the uninterrupted run."""
    from prefect.settings import PREFECT_API_URL

    run_dir, _, _ = rm_run
    overrides = [*with_reward_model(reward_dir), THREADS]
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PPOFLOW_PROGRESS": "0"}
    command = [
        sys.executable,
        "-m",
        "ppoflow",
        "train",
        *SMALL,
        *overrides,
        f"trainer.default_local_dir={tmp_path}",
    ]
    killed = subprocess.run(
        command, env=env | {"PPOFLOW_FAULT": "reward_model@1"}, capture_output=True, text=True
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not list(tmp_path.glob("iter=000001/reward_model/*.parquet"))
    rollouts = tmp_path / "iter=000001/rollouts/part-00000.parquet"
    inode = rollouts.stat().st_ino
    train(tmp_path, *overrides)
    assert rollouts.stat().st_ino == inode  # served from cache, not generated again
    for table in ("reward_model", "rewards", "advantages", "validation"):
        ours = rows(tmp_path, f"SELECT * FROM {table} ORDER BY ALL")
        assert ours == rows(run_dir, f"SELECT * FROM {table} ORDER BY ALL"), table


def test_remax_baselines_are_scored_by_the_reward_model_too(rm_run, reward_dir, tmp_path):
    """verl scores ReMax's greedy baseline batch with the reward model as well: the baseline score is
    the greedy response's rule score plus the weighted reward-model score of it."""
    remax = ["algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.n=2", "trainer.test_freq=2"]
    train(tmp_path, *with_reward_model(reward_dir), THREADS, *remax, "trainer.total_training_steps=1")
    scored = rows(
        tmp_path,
        "SELECT o.prompt_ids, o.baseline_response_ids, o.baseline_response_text, r.ground_truth, "
        "m.baseline_rm_score, r.baseline_score FROM rollouts o "
        "JOIN reward_model m USING (iter, prompt_id, sample_idx) "
        "JOIN rewards r USING (iter, prompt_id, sample_idx)",
    )
    assert len(scored) == 32 * 2
    plain = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    for r in scored:
        with torch.no_grad():
            own = plain(torch.tensor([r["prompt_ids"] + r["baseline_response_ids"]])).logits.item()
        assert r["baseline_rm_score"] == pytest.approx(own, rel=1e-5, abs=1e-5)
        rule = addition_components(r["baseline_response_text"], r["ground_truth"])
        expected = 0.9 * rule["correctness"] + 0.1 * rule["format"] + RM_WEIGHT * r["baseline_rm_score"]
        assert r["baseline_score"] == pytest.approx(expected, abs=1e-12)
    assert check_invariants(tmp_path) == {}
