"""trainer.logger=[console,wandb]: an offline wandb run under the run directory holding every metric of
every step, the config and the validation generations, read back with ppoflow's own .wandb reader.

The run is GRPO with KL in the reward and a KL loss, two validation samples per prompt and an epoch
boundary, so its metrics table also exercises what the PPO run of `small_run` does not: its metrics are
checked against SQL over its rows here too.
"""

from __future__ import annotations

import math

import pytest
import yaml

from ppoflow.tasks.observe.wandb_logger import has_api_key, wandb_mode
from ppoflow.tasks.observe.wandb_reader import BLOCK, offline_runs, read_run
from ppoflow.tasks.storage.confined_query import query
from ppoflow.tasks.storage.schemas import metric_doc

from .conftest import train
from .test_metrics_sql import assert_metrics_match_rows, assert_unrecomputable_are_plausible, logged_metrics

GENERATIONS = 3
OVERRIDES = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4",
    "data.train_batch_size=4",
    "data.train_max_samples=8",  # two steps per epoch: step 3 starts epoch 1
    "data.val_max_samples=10",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
    "actor_rollout_ref.rollout.val_kwargs.n=2",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    "trainer.total_training_steps=3",
    "trainer.logger=[console,wandb]",
    f"trainer.log_val_generations={GENERATIONS}",
    "trainer.project_name=ppoflow-tests",
    "trainer.experiment_name=grpo-offline",
]


@pytest.fixture(scope="module")
def wandb_run(prefect_server, tiny_model_dir, tmp_path_factory):
    """A real training through the flow with no wandb API key anywhere (so: offline)."""
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as env:
        for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
            env.delenv(name, raising=False)
        env.setenv("NETRC", str(home / "netrc"))  # no such file: no key
        for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            env.setenv(name, str(home / name.lower()))
        run_dir = tmp_path_factory.mktemp("wandb-run")
        summary, _ = train(run_dir, *OVERRIDES)
    return run_dir, summary, read_run(run_dir)


@pytest.fixture(scope="module")
def recomputed(wandb_run):
    """The run's metrics table checked against SQL over its rows, and that recomputation."""
    run_dir, _, _ = wandb_run
    return assert_metrics_match_rows(run_dir)


def equal(a, b) -> bool:
    return (isinstance(a, float) and math.isnan(a) and math.isnan(b)) or a == b


def test_the_offline_run_lives_in_the_run_directory(wandb_run):
    run_dir, summary, run = wandb_run
    assert [p.name.startswith("offline-run-") for p in offline_runs(run_dir)] == [True]
    assert (run.project, run.name) == ("ppoflow-tests", "grpo-offline")
    assert run.summary["run_dir"] == summary["run_dir"] == str(run_dir) and run.exit_code == 0
    # the history spans several 32 KiB blocks of the .wandb file, so the reader joined split records
    assert next(run.folder.glob("run-*.wandb")).stat().st_size > BLOCK


def test_history_holds_every_metric_of_every_step(wandb_run):
    run_dir, _, run = wandb_run
    logged = logged_metrics(run_dir)
    assert sorted(row["_step"] for row in run.history) == [0, 1, 2, 3]  # 0: validation before training
    for step in (1, 2, 3):
        history = run.step(step)
        row = {name: values[step] for name, values in logged.items() if step in values}
        assert len(row) > 60
        assert {name for name in row if not equal(history.get(name), row[name])} == set(), step


def test_validation_before_training_is_logged_at_step_0(wandb_run, recomputed):
    """At step 0 verl logs validation's metrics alone: so do wandb and the metrics table's row 0."""
    run_dir, _, run = wandb_run
    val = {name: values[0] for name, values in recomputed.items() if name.startswith("val-") and 0 in values}
    assert "val-core/ppoflow/addition/acc/best@2/mean" in val
    assert "val-core/ppoflow/addition/acc/maj@2/mean" in val
    history = run.step(0)
    assert {name: history[name] for name in val} == pytest.approx(val, rel=1e-9)
    row = {name: values[0] for name, values in logged_metrics(run_dir).items() if 0 in values}
    assert row == pytest.approx(val, rel=1e-9)
    assert {name for name in history if not name.startswith("_")} - {"val/generations"} == row.keys()


def test_config_is_the_runs_effective_config(wandb_run):
    run_dir, _, run = wandb_run
    config = {k: v for k, v in run.config.items() if k != "_wandb"}
    assert config == yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["trainer"]["logger"] == ["console", "wandb"]


def test_generations_are_the_first_validation_rows_of_each_step(wandb_run):
    run_dir, _, run = wandb_run
    for step in (0, 1, 2, 3):
        rows = run.table(run.step(step)["val/generations"])
        expected = query(
            run_dir,
            "SELECT prompt_text, response_text, score FROM read_parquet("
            f"'{run_dir}/iter={step:06d}/validation/part-00000.parquet') LIMIT {GENERATIONS}",
        )[1]
        assert [(r["prompt"], r["response"], r["score"], r["step"]) for r in rows] == [
            (*row, step) for row in expected
        ]


def test_grouped_run_metrics_match_sql_over_its_rows(wandb_run, recomputed):
    run_dir, _, _ = wandb_run
    assert_unrecomputable_are_plausible(run_dir)
    for name in (
        "critic/score/zero_spread_group_ratio",
        "actor/reward_kl_penalty",
        "actor/kl_loss",
        "val-core/ppoflow/addition/acc/best@2/mean",
    ):
        assert name in recomputed, name
    assert recomputed["training/epoch"] == {1: 0.0, 2: 0.0, 3: 1.0}
    assert "critic/values/mean" not in recomputed  # no critic
    assert [name for name in logged_metrics(run_dir) if metric_doc(name) is None] == []


def test_mode_is_offline_without_an_api_key(tmp_path):
    netrc = tmp_path / "netrc"
    no_key = {"NETRC": str(netrc)}
    assert not has_api_key(no_key) and wandb_mode(no_key) == "offline"
    assert wandb_mode(no_key | {"WANDB_MODE": "online"}) == "offline"  # never the network without a key
    assert wandb_mode(no_key | {"WANDB_MODE": "disabled"}) == "disabled"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password k3y\n")
    assert has_api_key(no_key) and wandb_mode(no_key) == "online"
    assert wandb_mode(no_key | {"WANDB_MODE": "offline"}) == "offline"
    assert not has_api_key(no_key | {"WANDB_BASE_URL": "https://wandb.example.com"})
    assert has_api_key({"NETRC": str(tmp_path / "none"), "WANDB_API_KEY": "k3y"})


def test_a_failed_training_finishes_its_wandb_run_as_failed(
    prefect_server, tiny_model_dir, tmp_path, monkeypatch
):
    from ppoflow.tasks.faults import FAULT_ENV, InjectedFault

    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv(FAULT_ENV, "rewards@2:raise")
    with pytest.raises(InjectedFault):
        train(tmp_path / "run", "trainer.logger=[console,wandb]")
    run = read_run(tmp_path / "run")
    assert run.exit_code == 1
    assert [row["_step"] for row in run.history] == [0, 1]
