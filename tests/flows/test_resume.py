"""Resume anything, lose nothing: SIGKILL inside each stage, then the same command again.

Every run here is a real `ppoflow train` process against the session's Prefect server, with one
torch thread so that numerics are identical between processes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from ppoflow.tasks.storage.confined_query import query

BASE = [
    "data.train_batch_size=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "critic.ppo_mini_batch_size=8",
    "critic.ppo_micro_batch_size_per_gpu=8",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.kl_ctrl.kl_coef=0.05",
    "algorithm.kl_ctrl.horizon=100",
    "actor_rollout_ref.rollout.val_kwargs.n=2",  # sampled validation resumes bit for bit too
    "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    "trainer.total_training_steps=3",
    "trainer.num_threads=1",
]
WALL_CLOCK = ("timing_s/", "timing_per_token_ms/", "perf/")


def ppoflow_train(run_dir: Path, *overrides: str, fault: str | None = None) -> subprocess.CompletedProcess:
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PPOFLOW_PROGRESS": "0"}
    env.pop("PPOFLOW_FAULT", None)
    if fault:
        env["PPOFLOW_FAULT"] = fault
    args = [
        sys.executable,
        "-m",
        "ppoflow",
        "train",
        *BASE,
        f"trainer.default_local_dir={run_dir}",
        *overrides,
    ]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def artifacts(run_dir: Path) -> dict[str, int]:
    """Inode of every stage output and checkpoint file: a stage that runs again replaces them."""
    patterns = ("iter=*/*/*.parquet", "data/*.parquet", "checkpoints/iter=*/*/model.safetensors")
    found = [p.relative_to(run_dir) for pattern in patterns for p in run_dir.glob(pattern)]
    visible = [p for p in found if not any(part.startswith(".") for part in p.parts)]  # not staging
    return {str(p): (run_dir / p).stat().st_ino for p in visible}


def final_weights(run_dir: Path, role: str) -> dict[str, torch.Tensor]:
    return load_file(run_dir / f"checkpoints/iter=000003/{role}/model.safetensors")


def metrics_without_wall_clock(run_dir: Path) -> list[dict]:
    rows = [pq.read_table(path).to_pylist()[0] for path in sorted(run_dir.glob("iter=*/metrics/*.parquet"))]
    return [{k: v for k, v in row.items() if not k.startswith(WALL_CLOCK)} for row in rows]


def assert_same_run(run_dir: Path, reference: Path) -> None:
    for role in ("actor", "critic"):
        ours, theirs = final_weights(run_dir, role), final_weights(reference, role)
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), (role, name)
    assert metrics_without_wall_clock(run_dir) == metrics_without_wall_clock(reference)
    for stage in ("rollouts", "rewards", "advantages", "validation"):
        for path in sorted(reference.glob(f"iter=*/{stage}/*.parquet")):
            mine = run_dir / path.relative_to(reference)
            assert pq.read_table(mine).equals(pq.read_table(path)), mine


@pytest.fixture(scope="module")
def reference(prefect_server, tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    done = ppoflow_train(run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


STEP_2_FAULTS = (
    "rollouts",
    "rewards",
    "advantages",
    "critic_update",
    "checkpoint",
    "actor_update",
    "validation",
)
"""The fault points of step 2, in the order a step reaches them (the critic's checkpoint is saved in
its update stage, after the update)."""


def _stage_of(fault: str) -> str:
    return "critic_update" if fault == "checkpoint" else fault  # the critic saves first


@pytest.mark.slow
def test_sigkill_in_each_stage_then_the_same_command_finishes_exactly_as_uninterrupted(reference, tmp_path):
    """The same command, SIGKILLed in each stage of step 2 in turn: every run resumes the one killed
    before it, runs again only the stage that was killed, and is killed in the next; the last one
    finishes, bit for bit the uninterrupted run."""
    killed_before = None
    for fault in (*STEP_2_FAULTS, None):
        before = artifacts(tmp_path)
        done = ppoflow_train(tmp_path, fault=None if fault is None else f"{fault}@2")
        if fault is None:
            assert done.returncode == 0, done.stderr[-3000:]
        else:
            assert done.returncode == -9, (fault, done.stderr[-3000:])
            assert not any(name.startswith("iter=000003") for name in artifacts(tmp_path)), fault
        after = artifacts(tmp_path)
        # The stage killed last time never finished: its own outputs may be written again, nothing else.
        rerun = [
            name
            for name, inode in before.items()
            if after.get(name) != inode
            and (killed_before is None or not name.startswith(f"iter=000002/{_stage_of(killed_before)}/"))
        ]
        assert rerun == [], f"after the kill in {killed_before}, finished stages ran again: {rerun}"
        killed_before = fault
    assert not list(tmp_path.glob("checkpoints/*/.*")), "staging files left behind"
    assert_same_run(tmp_path, reference)


@pytest.mark.slow
def test_states_between_saves_are_replayed_not_regenerated(prefect_server, tiny_model_dir, tmp_path_factory):
    """save_freq=2: the actor after step 1 is never written; killed in step 2's rollout, the rerun
    rebuilds it from the base checkpoint and step 1's cached tables, bit for bit."""
    uninterrupted = tmp_path_factory.mktemp("uninterrupted")
    assert ppoflow_train(uninterrupted, "trainer.save_freq=2").returncode == 0
    run_dir = tmp_path_factory.mktemp("replayed")
    assert ppoflow_train(run_dir, "trainer.save_freq=2", fault="rollouts@2").returncode == -9
    assert not (run_dir / "checkpoints/iter=000001").exists()
    before = artifacts(run_dir)
    assert ppoflow_train(run_dir, "trainer.save_freq=2").returncode == 0
    assert all(artifacts(run_dir)[name] == inode for name, inode in before.items())
    assert_same_run(run_dir, uninterrupted)


@pytest.mark.slow
def test_resume_from_a_checkpoint_path_continues_with_the_saved_kl_coefficient(reference, tmp_path):
    resumed = ppoflow_train(
        tmp_path,
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={reference / 'checkpoints/iter=000002'}",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert query(tmp_path, "SELECT DISTINCT iter FROM actor_update")[1] == [(3,)]
    beta = 'SELECT "actor/reward_kl_penalty_coeff" FROM metrics WHERE iter = 3'
    assert query(tmp_path, beta)[1] == query(reference, beta)[1]
    assert query(reference, beta)[1] != [(0.05,)]  # the adaptive controller had moved β
    for role in ("actor", "critic"):
        ours, theirs = final_weights(tmp_path, role), final_weights(reference, role)
        assert all(torch.equal(ours[name], theirs[name]) for name in ours), role
    # The validation before training is the resumed model's, logged at the step it was trained to
    # (verl's): its metrics row is iter 2, with the scores the reference validated step 2 with.
    core = 'SELECT iter, "val-core/ppoflow/addition/acc/mean@2", "critic/score/mean" IS NULL FROM metrics'
    assert query(tmp_path, f"{core} ORDER BY iter")[1] == [
        (2, query(reference, f"{core} WHERE iter = 2")[1][0][1], True),
        *query(reference, f"{core} WHERE iter = 3")[1],
    ]


@pytest.mark.slow
def test_resuming_a_run_from_its_own_checkpoint_keeps_the_steps_row_and_manifest(reference, tmp_path):
    """The validation before training at step 2 of a run that trained step 2: its row and manifest
    stand (a validation-only row there would replace the step's training metrics)."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    kept = ("iter=000002/_manifest.json", "iter=000002/metrics/part-00000.parquet")
    before = {name: (run_dir / name).read_bytes() for name in kept}
    resumed = ppoflow_train(
        run_dir,
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={run_dir / 'checkpoints/iter=000002'}",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert {name: (run_dir / name).read_bytes() for name in kept} == before
    assert_same_run(run_dir, reference)


def test_the_two_newest_checkpoints_keep_optimizer_state_and_an_older_one_is_refused_for_resume(
    reference, tmp_path
):
    kept = sorted(p.relative_to(reference).as_posix() for p in reference.glob("checkpoints/iter=*/*.optim"))
    assert kept == [f"checkpoints/iter=00000{k}/{role}.optim" for k in (2, 3) for role in ("actor", "critic")]
    assert len(list(reference.glob("checkpoints/iter=*/actor/model.safetensors"))) == 3  # weights all kept
    refused = ppoflow_train(
        tmp_path,
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={reference / 'checkpoints/iter=000001'}",
    )
    assert refused.returncode != 0
    [line] = [line for line in refused.stderr.splitlines() if "optimizer state is not there" in line]
    assert "iter=000001" in line and "newest 2 checkpoints" in line
    assert not (tmp_path / "iter=000002").exists()


def test_an_update_lost_after_its_parents_optimizer_state_was_pruned_is_replayed_from_the_base_model(
    reference, tmp_path
):
    """Step 2's update tables are deleted; step 1's checkpoint no longer has optimizer state (only the
    two newest keep it), or not even its actor's weights and tokenizer, so step 1 is rebuilt by
    replaying its update on the base model, then step 2 trained again."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    assert not (run_dir / "checkpoints/iter=000001/actor.optim").exists()
    for role in ("actor", "critic"):
        shutil.rmtree(run_dir / f"iter=000002/{role}_update")
    shutil.rmtree(run_dir / "checkpoints/iter=000001/actor")
    resumed = ppoflow_train(run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rebuilt = [line for line in resumed.stdout.splitlines() if line.startswith("rebuilding")]
    assert sorted(rebuilt) == [
        f"rebuilding the actor of step 1 by replaying its update: checkpoint {run_dir}/checkpoints/"
        "iter=000001/actor of the actor at step 1 is missing",
        "rebuilding the critic of step 1 by replaying its update: the optimizer state of the critic at "
        "step 1 was not kept (only the newest 2 checkpoints of a role keep it)",
    ]
    assert_same_run(run_dir, reference)


def test_a_second_writer_is_refused_and_a_dead_ones_lock_is_taken_over(
    prefect_server, tiny_model_dir, tmp_path
):
    hold = (
        "import sys, time; from ppoflow.tasks.storage.lock import acquire_run_lock as take; "
        "take(sys.argv[1]); "
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold + "print('held', flush=True); time.sleep(3600)", str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        refused = ppoflow_train(tmp_path, "trainer.total_training_steps=1")
        assert refused.returncode != 0
        assert f"being written by process {holder.pid} on {os.uname().nodename}" in refused.stderr
        assert not (tmp_path / "iter=000001").exists()
    finally:
        holder.kill()  # SIGKILL: the kernel frees its lock
        holder.wait()
    taken_over = ppoflow_train(tmp_path, "trainer.total_training_steps=1")
    assert taken_over.returncode == 0, taken_over.stderr[-3000:]
    assert (tmp_path / ".lock").read_text() == ""  # released: the holder's record is cleared
    free = subprocess.run([sys.executable, "-c", hold, str(tmp_path)], capture_output=True, text=True)
    assert free.returncode == 0, free.stderr[-3000:]
