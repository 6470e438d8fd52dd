"""The ppo-train flow under a real Prefect server: tables, invariants, caching, GRPO (metrics vs SQL:
test_metrics_sql.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from safetensors.torch import load_file

from ppoflow.tasks.storage.catalog import check_invariants
from ppoflow.tasks.storage.confined_query import query
from ppoflow.tasks.storage.manifests import committed_iterations, read_manifest, trained_iterations
from ppoflow.tasks.storage.schemas import SCHEMAS
from ppoflow.tasks.storage.tables import file_digest

from .conftest import train


def task_states(flow_run_id, expected: int | None = None) -> dict[str, str | None]:
    """Final state of every task of a flow run, by task run name (a stage whose cached result was
    invalid runs again under the same name: the later run wins). The server records task runs and
    their states from events, after the flow has returned: wait until every run has a final state
    and their number is `expected` (when given) or has not changed for 2 s; fails naming the states it
    has at the deadline."""
    from ppoflow.prefect_server import deliver_prefect_logs_and_events

    deliver_prefect_logs_and_events(timeout_s=120)  # every event of this process is at the server
    deadline, previous, unchanged_since = time.monotonic() + 120, None, time.monotonic()
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
        runs = sorted(runs, key=lambda run: run.created)
        states = {run.name: run.state.name if run.state else None for run in runs}
        final = bool(states) and not {None, "Pending", "Running"} & set(states.values())
        if states != previous:
            previous, unchanged_since = states, time.monotonic()
        settled = time.monotonic() - unchanged_since >= 2
        if final and (len(runs) == expected if expected else settled):
            return states
        assert time.monotonic() < deadline, f"the task runs' states did not settle: {states}"
        time.sleep(0.25)


def scalar(run_dir, sql):
    return query(run_dir, sql)[1][0][0]


def test_actor_and_critic_parameters_changed(small_run):
    run_dir, summary, _ = small_run
    base = load_file(run_dir / "model/base/model.safetensors")
    final = load_file(run_dir / "checkpoints/iter=000002/actor/model.safetensors")
    umask = os.umask(0o077)
    os.umask(umask)
    weights = ("model/base/model.safetensors", "checkpoints/iter=000002/actor/model.safetensors")
    for path in ("model/base", *weights):
        mode = (run_dir / path).stat().st_mode & 0o777  # readable as the umask allows, like every run file
        assert mode == (0o777 if (run_dir / path).is_dir() else 0o666) & ~umask, path
    assert summary["actor_checkpoint"] == str(run_dir / "checkpoints/iter=000002/actor")
    assert any(not torch.equal(base[k], final[k]) for k in base)
    critic = load_file(run_dir / "checkpoints/iter=000002/critic/model.safetensors")
    assert torch.count_nonzero(critic["score.weight"]) > 0  # the value head left its zero init


def test_every_table_has_its_rows_and_schema(small_run):
    run_dir, _, _ = small_run
    # 2 iterations × 2 mini-batches × (4 actor epochs | 1 critic epoch, the embedded default)
    expected = {
        "rollouts": 64,
        "rewards": 64,
        "advantages": 64,
        "validation": 300,
        "metrics": 3,  # validation before training (iter 0), then one row per step
        "actor_update": 2 * 2 * 4,
        "critic_update": 2 * 2 * 1,
        "prompts": 2048 + 100,
    }
    for view, rows in expected.items():
        assert scalar(run_dir, f"SELECT count(*) FROM {view}") == rows, view
    for view in ("rollouts", "rewards", "advantages", "validation", "actor_update", "critic_update"):
        columns = [row[0] for row in query(run_dir, f"DESCRIBE {view}")[1]]
        assert columns == ["iter", *SCHEMAS[view].names], view
    assert query(run_dir, "SELECT DISTINCT iter FROM rollouts ORDER BY iter")[1] == [(1,), (2,)]
    assert query(run_dir, "SELECT DISTINCT iter FROM validation ORDER BY iter")[1] == [(0,), (1,), (2,)]
    assert scalar(run_dir, "SELECT count(DISTINCT role) FROM updates") == 2
    assert check_invariants(run_dir) == {}


def test_validation_before_training_is_the_metrics_row_of_step_0(small_run):
    """verl logs the validation before training at step 0: the metrics table has that row, with the
    names the steps' rows carry and NULL in every training column, committed as step 0."""
    run_dir, summary, _ = small_run
    core = "val-core/ppoflow/addition/acc/mean@1"
    rows = query(
        run_dir,
        f'SELECT iter, step, "{core}", "critic/score/mean" IS NULL, "timing_s/step" IS NULL, '
        '"training/global_step" FROM metrics ORDER BY iter',
    )[1]
    val = dict(query(run_dir, "SELECT iter, avg(score) FROM validation GROUP BY iter")[1])
    assert rows == [
        (0, 0, pytest.approx(val[0]), True, True, None),
        (1, 1, pytest.approx(val[1]), False, False, 1.0),
        (2, 2, pytest.approx(val[2]), False, False, 2.0),
    ]
    assert summary["validation"] == [[step, pytest.approx(val[step])] for step in (0, 1, 2)]
    columns, [row] = query(run_dir, "SELECT * FROM metrics WHERE iter = 0")
    filled = {column for column, value in zip(columns, row, strict=True) if value is not None}
    assert filled == {"iter", "step", *(c for c in columns if c.startswith(("val-core/", "val-aux/")))}
    stages = read_manifest(run_dir, 0)["stages"]
    assert sorted(stages) == ["metrics", "validation"] and stages["metrics"]["rows"] == 1
    assert committed_iterations(run_dir) == [0, 1, 2] and trained_iterations(run_dir) == [1, 2]


def test_rerunning_the_same_command_is_served_entirely_from_cache(small_run):
    run_dir, summary, first_id = small_run
    assert set(task_states(first_id).values()) == {"Completed"}
    kept = (
        "iter=000002/_manifest.json",
        "iter=000000/_manifest.json",
        "iter=000000/metrics/part-00000.parquet",
    )
    before = {name: (run_dir / name).read_bytes() for name in kept}
    again, second_id = train(run_dir)
    first = task_states(first_id)
    assert {"validation-step0", "metrics-step0"} <= first.keys()
    states = task_states(second_id, expected=len(first))
    assert len(states) == len(first) and set(states.values()) == {"Cached"}
    assert again["val_scores"] == summary["val_scores"]
    assert {name: (run_dir / name).read_bytes() for name in kept} == before


def test_deleted_artifact_is_a_cache_miss_and_is_rebuilt(small_run, tmp_path):
    run_dir, summary, _ = small_run
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    reward = copy / "iter=000002/rewards/part-00000.parquet"
    rollout = copy / "iter=000002/rollouts/part-00000.parquet"
    digest, kept = file_digest(reward), os.stat(rollout)
    reward.unlink()
    again, _ = train(copy)
    assert file_digest(reward) == digest  # rebuilt, the same bytes
    after = os.stat(rollout)  # the rollouts, whose file was intact, were not written again
    assert (after.st_ino, after.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)
    assert again["val_scores"] == summary["val_scores"]


def test_grpo_runs_through_the_same_flow_without_critic(prefect_server, tiny_model_dir, tmp_path):
    summary, _ = train(
        tmp_path,
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=8",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.test_freq=2",
    )
    assert scalar(tmp_path, "SELECT count(*) FROM rollouts") == 2 * 8 * 8
    assert scalar(tmp_path, "SELECT count(*) FROM critic_update") == 0
    assert scalar(tmp_path, 'SELECT count(*) FROM advantages WHERE "values" IS NOT NULL') == 0
    assert (
        scalar(
            tmp_path,
            "SELECT max(n) FROM (SELECT count(DISTINCT group_id) n FROM rollouts GROUP BY iter, prompt_id)",
        )
        == 1
    )
    zero_spread = scalar(
        tmp_path, 'SELECT "critic/score/zero_spread_group_ratio" FROM metrics WHERE iter = 1'
    )
    assert 0.0 <= zero_spread <= 1.0
    assert not (tmp_path / "checkpoints/iter=000002/critic").exists()
    assert len(summary["val_scores"]) == 2  # before training and at the last step (test_freq=2)
    assert check_invariants(tmp_path) == {}


def test_saved_actor_loads_in_plain_transformers_and_generates(small_run):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    run_dir, _, _ = small_run
    path = run_dir / "checkpoints/iter=000002/actor"
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    ids = tokenizer("3 + 4 = ", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert answer.strip().isdigit()


def test_critic_warmup_updates_only_the_critic_first(prefect_server, tiny_model_dir, tmp_path):
    train(tmp_path, "trainer.critic_warmup=2", "trainer.test_freq=2")  # verl: actor once warmup <= step
    assert query(tmp_path, "SELECT DISTINCT iter FROM actor_update ORDER BY iter")[1] == [(2,)]
    assert query(tmp_path, "SELECT DISTINCT iter FROM critic_update ORDER BY iter")[1] == [(1,), (2,)]
    assert not (tmp_path / "checkpoints/iter=000001/actor").exists()
    assert query(tmp_path, 'SELECT iter, "actor/pg_loss" IS NULL FROM metrics ORDER BY iter')[1] == [
        (0, True),  # the validation before training
        (1, True),
        (2, False),
    ]
    # the actor that generated step 2 is still the base model
    assert scalar(tmp_path, "SELECT DISTINCT policy_version FROM rollouts WHERE iter = 2") == 0
