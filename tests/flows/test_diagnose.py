"""`ppoflow diagnose` on small real runs of the tiny model that exhibit each finding (lr 1e-6,
lr 0.1, a reward that is always 0, GRPO groups without spread, one on-policy step per iteration,
training on 32 prompts), and the errors for directories with nothing to diagnose (missing, in
progress, validation only). tests/tasks/observe/test_diagnose_checks.py tests each check on hand-built metric
rows at its thresholds' edges."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest

from ppoflow.tasks.observe.diagnose import (
    RunDirError,
    RunInProgress,
    ValidationOnlyRun,
    diagnose,
    exit_code,
    load_run,
)
from ppoflow.tasks.observe.diagnose_run import Finding, fitted_change
from ppoflow.tasks.storage.confined_query import query
from ppoflow.tasks.storage.tables import write_table
from tests.tasks.observe.test_diagnose_checks import evidence

from .conftest import train

# A verl-signature reward that pays nothing, whatever the response.
ZERO_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
"""
NO_VALIDATION = ["trainer.val_before_train=false", "trainer.test_freq=-1"]
RUNS = {
    # Actor lr 1e-6: gradients but no movement. Critic lr 3.0: the critic diverges.
    # max_response_length 2 cuts every two-digit sum.
    "still": [
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.optim.warmup_style=constant",
        "actor_rollout_ref.actor.ppo_epochs=2",
        "critic.optim.lr=3.0",
        "data.max_response_length=2",
        "trainer.total_training_steps=3",
        *NO_VALIDATION,
    ],
    # Actor lr 0.1 with a KL loss: one iteration jumps and the policy turns deterministic (what it
    # collapses to depends on the base: seed 1's answers "555" to most prompts).
    "collapse": [
        "actor_rollout_ref.actor.optim.lr=0.1",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.total_training_steps=3",
        "data.val_max_samples=20",
    ],
    "zero_ppo": ["custom_reward_function.path={zero}", *NO_VALIDATION],
    "zero_grpo": [
        "custom_reward_function.path={zero}",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        *NO_VALIDATION,
    ],
    # One mini-batch, one epoch: each update is on-policy, ppo_kl and clipfrac are 0 by construction.
    "on_policy": [
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.actor.ppo_epochs=1",
        *NO_VALIDATION,
    ],
    # The same 32 prompts every iteration at lr 5e-4: training reward up, validation down (5 steps,
    # one thread: validation_diverges for seeds 1, 2, 3 and 5, training reward fitted +0.12 to +0.21,
    # validation -0.08 to -0.21, most beside a critic_not_fitting warning; seed 4's base, at 0.87,
    # gives no such finding; at 7e-4 an earlier base's first step alone took validation from 0.775 to
    # 0.505 while training reward barely rose).
    "overfit": [
        "data.train_max_samples=32",
        "actor_rollout_ref.actor.optim.lr=5e-4",
        "trainer.total_training_steps=5",
    ],
    # Validation only (verl's trainer.val_only): validation rows and their metrics row at iteration 0.
    "val_only": ["trainer.val_only=true", "data.val_max_samples=20"],
    # One iteration (test_report: one point per curve).
    "one_iteration": ["trainer.total_training_steps=1", "data.val_max_samples=20"],
}
_DONE: dict[str, object] = {}


def real_run(tmp_path_factory, name: str):
    """The run directory of RUNS[name], trained once per session (test_report shares them)."""
    if name not in _DONE:
        zero = tmp_path_factory.mktemp("reward") / "zero_reward.py"
        zero.write_text(textwrap.dedent(ZERO_REWARD))
        run_dir = tmp_path_factory.mktemp(name)
        train(run_dir, *(o.format(zero=zero) for o in RUNS[name]))
        _DONE[name] = run_dir
    return _DONE[name]


@pytest.fixture(scope="module")
def runs(prefect_server, tiny_model_dir, tmp_path_factory):
    return lambda name: real_run(tmp_path_factory, name)


TRAINED = 'WHERE "training/global_step" IS NOT NULL'
"""The rows of training steps (not the validation before training's)."""


def metric(run_dir, name: str) -> list[float]:
    return [row[0] for row in query(run_dir, f'SELECT "{name}" FROM metrics {TRAINED} ORDER BY iter')[1]]


def by_check(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings}


# Real runs of the tiny model.


def test_lr_1e6_policy_not_moving_lr_too_small_critic_diverging_truncation(runs):
    run_dir = runs("still")
    found = by_check(diagnose(load_run(run_dir)))
    kl, grad = metric(run_dir, "actor/ppo_kl"), metric(run_dir, "actor/grad_norm")
    assert max(map(abs, kl)) < 1e-3 and min(grad) > 0.1
    assert found["policy_not_moving"].severity == "warning"
    assert evidence(found["policy_not_moving"], "actor/ppo_kl") == pytest.approx(kl, rel=1e-5)
    assert evidence(found["policy_not_moving"], "actor_update/steps") == (4.0, 4.0, 4.0)  # 2 epochs × 2
    assert "lr 1e-06 is too small" in found["learning_rate"].title
    ev, loss = metric(run_dir, "critic/vf_explained_var"), metric(run_dir, "critic/vf_loss")
    assert max(ev[1:]) < -0.1 and max(loss[1:]) / loss[0] >= 10
    assert found["critic_not_fitting"].severity == "critical"
    truncated = query(run_dir, "SELECT avg((finish_reason = 'length')::DOUBLE) FROM rollouts GROUP BY iter")[
        1
    ]
    assert min(t for (t,) in truncated) > 0.3  # every two-digit sum is cut at 2 tokens
    assert "(2 tokens)" in found["response_truncation"].title
    assert "aggressive_updates" not in found and "entropy_collapse" not in found


def test_lr_01_aggressive_updates_collapse_and_kl_to_reference(runs):
    run_dir = runs("collapse")
    found = by_check(diagnose(load_run(run_dir)))
    kl, entropy = metric(run_dir, "actor/ppo_kl"), metric(run_dir, "actor/entropy")
    assert kl[0] > 1.0 and found["aggressive_updates"].severity == "critical"
    assert min(entropy[1:]) < 1e-3 and found["entropy_collapse"].severity == "critical"
    assert "too large" in found["learning_rate"].title
    kl_loss = metric(run_dir, "actor/kl_loss")
    assert min(kl_loss) > 1.0  # the collapsed policy is far from the reference from the first update on
    # Whether it still rises after that jump depends on the CPU's rounding (on an AMD EPYC it falls
    # back a little: 6.81, 5.98, 6.24); the finding follows the fitted trend, as
    # tests/tasks/observe/test_diagnose_checks.py::test_reference_kl_edges pins down at its edges.
    runaway = found.get("reference_kl_runaway")
    assert (runaway is not None) == (fitted_change(list(enumerate(kl_loss, start=1))) > 0), kl_loss
    assert runaway is None or (runaway.title.endswith("rising") and "actor/kl_loss" in runaway.title)
    assert "policy_not_moving" not in found  # a still policy after a jump is collapse, not a small lr


def test_zero_reward_is_no_signal_and_explained_variance_is_called_meaningless(runs):
    run_dir = runs("zero_ppo")
    assert query(run_dir, "SELECT count(DISTINCT score), max(score) FROM rewards")[1] == [(1, 0.0)]
    found = by_check(diagnose(load_run(run_dir)))
    reward = found["reward_constant"]
    assert reward.severity == "critical" and "every response scores 0 in every iteration" in reward.title
    assert evidence(reward, "critic/vf_explained_var") == tuple(metric(run_dir, "critic/vf_explained_var"))
    assert any("meaningless" in c for c in reward.causes)
    assert "critic_not_fitting" not in found  # returns without variance say nothing about the critic
    assert "reward.weights" not in reward.config_keys  # they are 0.9 and 0.1: not the cause
    assert "advantage is 0" in found["policy_not_moving"].causes[0]


def test_grpo_with_zero_reward_has_no_group_spread(runs):
    run_dir = runs("zero_grpo")
    found = by_check(diagnose(load_run(run_dir)))
    assert metric(run_dir, "critic/score/zero_spread_group_ratio") == [1.0, 1.0]
    groups = query(run_dir, "SELECT count(DISTINCT group_id) FROM rollouts WHERE iter = 1")[1][0][0]
    assert groups == 8
    zero = found["zero_spread_groups"]
    assert zero.severity == "critical" and "100% of grpo groups (n=4)" in zero.title
    assert found["reward_constant"].severity == "critical"


def test_one_minibatch_one_epoch_is_policy_not_moving_as_expected(runs):
    run_dir = runs("on_policy")
    assert metric(run_dir, "actor/ppo_kl") == [0.0, 0.0] and metric(run_dir, "actor/pg_clipfrac") == [
        0.0,
        0.0,
    ]
    findings = diagnose(load_run(run_dir))
    assert [(f.check, f.severity) for f in findings] == [("policy_not_moving", "info")]
    assert evidence(findings[0], "actor_update/steps") == (1.0, 1.0)
    assert exit_code(findings) == 0


def test_training_on_32_prompts_rises_while_validation_falls(runs):
    run_dir = runs("overfit")
    train_reward = metric(run_dir, "critic/score/mean")
    val = [
        v for _, v in query(run_dir, "SELECT iter, avg(score) FROM validation GROUP BY iter ORDER BY iter")[1]
    ]
    assert train_reward[-1] > train_reward[0] and val[-1] < val[0]
    found = by_check(diagnose(load_run(run_dir)))
    finding = found["validation_diverges"]
    assert finding.severity == "warning" and "validation falls" in finding.title
    assert not any(f.severity == "critical" for f in found.values())
    assert evidence(finding, "validation/score_mean") == pytest.approx(val, rel=1e-5)
    # 100 validation prompts: the fall is several standard errors (≈ 0.04) deep.
    sem = query(
        run_dir, "SELECT stddev_samp(score) / sqrt(count(*)) FROM validation GROUP BY iter ORDER BY iter"
    )[1]
    assert evidence(finding, "validation/score_sem") == pytest.approx([s for (s,) in sem], rel=1e-5)
    assert fitted_change(list(enumerate(val))) < -2 * max(s for (s,) in sem)


def ppoflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ppoflow", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_text_json_and_exit_codes(runs, tmp_path):
    still, quiet = runs("still"), runs("on_policy")
    text = ppoflow("diagnose", str(still))
    assert text.returncode == 1, text.stderr
    assert "CRITICAL critic_not_fitting" in text.stdout and "WARNING  policy_not_moving" in text.stdout
    assert "actor_rollout_ref.actor.optim.lr: 1e-06 → raise it ×10" in text.stdout
    as_json = json.loads(ppoflow("diagnose", str(still), "--format", "json").stdout)
    assert as_json["exit_code"] == 1 and as_json["iterations"] == [1, 2, 3]
    checks = {f["check"]: f for f in as_json["findings"]}
    assert {"policy_not_moving", "learning_rate", "critic_not_fitting", "response_truncation"} <= set(checks)
    kl = next(e for e in checks["policy_not_moving"]["evidence"] if e["metric"] == "actor/ppo_kl")
    assert kl["iters"] == [1, 2, 3] and kl["values"] == pytest.approx(metric(still, "actor/ppo_kl"), rel=1e-5)
    ok = ppoflow("diagnose", str(quiet))
    assert ok.returncode == 0 and "INFO     policy_not_moving" in ok.stdout
    not_a_run = ppoflow("diagnose", str(tmp_path))
    assert not_a_run.returncode == 2 and "not a ppoflow run directory" in not_a_run.stderr
    assert "Traceback" not in not_a_run.stderr


def test_load_run_says_what_is_wrong(runs, tmp_path):
    with pytest.raises(RunDirError, match="does not exist"):
        load_run(tmp_path / "missing")
    with pytest.raises(RunDirError, match="not a ppoflow run directory: it has no config.yaml"):
        load_run(tmp_path)
    (tmp_path / "config.yaml").write_text("trainer:\n  val_only: false\n")
    in_progress = "no training step has finished yet .the run is in progress, or stopped before"
    with pytest.raises(RunInProgress, match=in_progress):
        load_run(tmp_path)  # started: config.yaml, no table yet
    val_only = runs("val_only")
    with pytest.raises(ValidationOnlyRun, match="validation-only run: nothing to diagnose") as raised:
        load_run(val_only)
    assert f'`ppoflow query {val_only} "SELECT * FROM validation"`' in str(raised.value)
    # The same rows under a config without val_only are a run stopped (or still running) after its
    # step-0 validation: in progress, not validation-only. A copy reads its own files, no catalog.
    copy = tmp_path / "copy"
    shutil.copytree(val_only, copy)
    (copy / "config.yaml").write_text("trainer:\n  val_only: false\n")
    (copy / "catalog.duckdb").unlink()
    with pytest.raises(RunInProgress, match=in_progress):
        load_run(copy)
    scores = dict(query(val_only, "SELECT iter, avg(score) FROM validation GROUP BY iter")[1])
    loaded = load_run(copy, require_metrics=False)
    assert loaded.rows["validation/score_mean"] == pytest.approx(scores)
    assert loaded.metrics["val-core/ppoflow/addition/acc/mean@1"] == pytest.approx(scores)
    assert loaded.trained_iterations() == []
    cli = ppoflow("diagnose", str(val_only))
    assert cli.returncode == 2 and "validation-only run" in cli.stderr and "Traceback" not in cli.stderr


def test_cli_exits_141_when_the_reader_closes_the_pipe(runs):
    """`ppoflow diagnose … | head -1`: a pipe whose reader has gone, as head leaves it."""
    read, write = os.pipe()
    os.close(read)
    try:
        for fmt in ("json", "text"):
            out = subprocess.run(
                [sys.executable, "-m", "ppoflow", "diagnose", str(runs("on_policy")), "--format", fmt],
                stdout=write,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
            )
            assert out.returncode == 141 and out.stderr == "", (fmt, out.stderr)
    finally:
        os.close(write)


def test_a_planted_column_is_no_metric_and_a_damaged_file_is_named_with_the_fix(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs("on_policy"), run)
    write_table(pa.table({"step": [1], "note": ["hello"]}), run, "iter=000001/metrics/part-00001.parquet")
    loaded = load_run(run)
    assert "note" not in loaded.metrics and loaded.metrics["critic/score/mean"]
    rewards = run / "iter=000002/rewards/part-00000.parquet"
    os.truncate(rewards, 500)
    fix = "a table file of the run is damaged: run the training command again"
    with pytest.raises(RunDirError, match=fix):
        load_run(run)
    with pytest.raises(ValueError, match=f"(?s){rewards}.*{fix}"):
        query(run, "SELECT count(*) FROM rewards")
    cli = ppoflow("report", str(run), "--out", str(tmp_path / "report"))
    assert cli.returncode == 2 and fix in cli.stderr and "Traceback" not in cli.stderr
