"""Scale-out on CPU: worker groups of two ranks on Ray (gloo) training with FSDP2 and DeepSpeed ZeRO,
compared with one process on the same machine. Every run uses one torch thread per process, so a
rank's kernels are the ones the single process runs (the thread count changes float reductions).

Measured here (and asserted within the tolerances below, on any CPU): FSDP2 with gradient
clipping and DeepSpeed ZeRO-2 with a clip that does not bind give the same tokens, and weights and
log-probs, values and advantages within WEIGHTS_TOLERANCE and TABLE_TOLERANCE: bit-identical on an
Intel Xeon; on an AMD EPYC, whose kernels round a rank's half batch differently from the whole,
weights up to 1.2e-4 apart after one step and the second step's log-probs up to 1.3e-4;
ZeRO-3 (and ZeRO with a binding clip, whose norm DeepSpeed sums in its own order) differs in the
last bits from the first optimizer step on, which AdamW amplifies to ~2e-4 after two iterations.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import duckdb
import pytest
from safetensors import safe_open
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

COMMON = [
    "trainer.total_training_steps=2",
    "trainer.num_threads=1",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.device=cpu",
]
TWO = ["trainer.n_gpus_per_node=2"]
FSDP2 = [*TWO, "actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2"]
GRPO = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4",
    "data.train_batch_size=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",  # one micro-batch per rank
    "actor_rollout_ref.actor.grad_clip=100",
]
SMALL_PPO = [
    "data.train_batch_size=32",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "critic.ppo_mini_batch_size=16",
    "critic.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.grad_clip=100",
    "critic.grad_clip=100",
]
TABLES = {
    "rollouts": "response_ids, rollout_log_probs, old_log_probs",
    "rewards": "score",
    "advantages": "values, advantages, returns",
}


def _train(run_dir: Path, *overrides: str) -> Path:
    from ppoflow.flows.train import ppo_train

    ppo_train(None, [*COMMON, f"trainer.default_local_dir={run_dir}", *overrides])
    return run_dir


def _table(run_dir: Path, name: str, iteration: int | None = None) -> list:
    where = f"iter={iteration:06d}" if iteration is not None else "iter=*"
    return duckdb.sql(
        f"SELECT {TABLES[name]} FROM read_parquet('{run_dir}/{where}/{name}/*.parquet') "
        "ORDER BY prompt_id, sample_idx"
    ).fetchall()


WEIGHTS_TOLERANCE = 3e-3
"""The largest difference allowed between two runs' weights after two steps: AdamW moves a weight by
up to its learning rate (3e-4 here) an optimizer step whatever the gradient's size (8 optimizer steps
an iteration here), so a rounding difference in a gradient near zero can move it several times that.
Measured: 1.9e-3 (the ZeRO-3 actor at step 2, 2-core Intel Xeon)."""
TABLE_TOLERANCE = 1e-3
"""The largest difference allowed between two runs' float columns (token ids and lengths: none)."""


def _assert_same_tables(a: Path, b: Path, iteration: int | None = None, names=tuple(TABLES)) -> None:
    """The tables of two runs hold the same tokens, and floats within TABLE_TOLERANCE."""
    for name in names:
        first, second = _table(a, name, iteration), _table(b, name, iteration)
        assert len(first) == len(second), name
        for row, (x, y) in enumerate(zip(first, second, strict=True)):
            for column, (u, v) in enumerate(zip(x, y, strict=True)):
                assert _close(u, v), (name, row, TABLES[name].split(", ")[column], u, v)


def _close(u, v) -> bool:
    if isinstance(u, list):
        return (
            isinstance(v, list) and len(u) == len(v) and all(_close(p, q) for p, q in zip(u, v, strict=True))
        )
    if isinstance(u, float):
        return isinstance(v, float) and abs(u - v) <= TABLE_TOLERANCE
    return u == v


def _weights_gap(a: Path, b: Path, step: int, role: str) -> float:
    first = load_file(a / f"checkpoints/iter={step:06d}/{role}/model.safetensors")
    second = load_file(b / f"checkpoints/iter={step:06d}/{role}/model.safetensors")
    assert first.keys() == second.keys()
    return max((first[k] - second[k]).abs().max().item() for k in first)


def _optimizer_parts(run_dir: Path, step: int, role: str) -> list[set[str]]:
    """The tensor names in each rank's file of a checkpoint's optimizer state."""
    parts = sorted((run_dir / f"checkpoints/iter={step:06d}/{role}.optim").glob("*.safetensors"))
    names = []
    for part in parts:
        with safe_open(part, "pt") as f:
            names.append(set(f.keys()))
    return names


@pytest.fixture(scope="module")
def one_process(prefect_server, tiny_model_dir, tmp_path_factory):
    """The embedded default (PPO with a critic) in this process: the reference of the FSDP2 runs."""
    return _train(tmp_path_factory.mktemp("one"))


@pytest.fixture(scope="module")
def fsdp2(prefect_server, tiny_model_dir, tmp_path_factory):
    """The acceptance command line: the embedded default on two ranks with FSDP2."""
    return _train(tmp_path_factory.mktemp("fsdp2"), *FSDP2)


def test_fsdp2_on_two_ranks_equals_one_process(one_process, fsdp2):
    _assert_same_tables(fsdp2, one_process)
    for role in ("actor", "critic"):
        for step in (1, 2):
            assert _weights_gap(one_process, fsdp2, step, role) <= WEIGHTS_TOLERANCE, (role, step)
    actor = duckdb.sql(
        f"SELECT count(*), max(grad_norm) FROM read_parquet('{fsdp2}/iter=*/actor_update/*.parquet')"
    ).fetchall()[0]
    assert actor[0] == 2 * 8 * 4 and actor[1] > 1.0  # 8 mini-batches × 4 epochs; the clip at 1.0 binds
    parts = _optimizer_parts(fsdp2, 2, "actor")  # each rank wrote its shard of every moment
    assert len(parts) == 2 and parts[0] == parts[1] == _optimizer_parts(one_process, 2, "actor")[0]


BUDGETS = [  # rows of up to 20 tokens: micro-batches of uneven sizes, more on one rank than the other
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=90",
    "critic.use_dynamic_bsz=true",
    "critic.ppo_max_token_len_per_gpu=70",
    "critic.forward_max_token_len_per_gpu=110",
]


def test_token_budgets_on_two_ranks_equal_one_process(one_process, tmp_path):
    """use_dynamic_bsz in a worker group: each rank cuts its share by the budget and all run the
    largest count (a sharded pass needs every rank), here an actor under ZeRO-3 and a critic under
    FSDP2, whose value pass also runs by budget; the run is the one-process run within tolerance."""
    budgets = _train(
        tmp_path / "budgets",
        *BUDGETS,
        *TWO,
        "actor_rollout_ref.actor.strategy=deepspeed",
        "actor_rollout_ref.actor.deepspeed_config.zero_stage=3",
        "critic.strategy=fsdp2",
    )
    _assert_same_tables(budgets, one_process, 1)
    for role in ("actor", "critic"):
        assert _weights_gap(one_process, budgets, 1, role) <= WEIGHTS_TOLERANCE, role


@pytest.fixture(scope="module")
def one_grpo(prefect_server, tiny_model_dir, tmp_path_factory):
    """GRPO in this process: the reference of the ZeRO-2 run and of a resume on two ranks."""
    return _train(tmp_path_factory.mktemp("one-grpo"), *GRPO)


@pytest.fixture(scope="module")
def one_small_ppo(prefect_server, tiny_model_dir, tmp_path_factory):
    """A small PPO run in this process: the reference of the ZeRO-3 run and of a resume on one rank."""
    return _train(tmp_path_factory.mktemp("one-small-ppo"), *SMALL_PPO)


def test_deepspeed_zero2_grpo_on_two_ranks_equals_one_process(one_grpo, tmp_path):
    one = one_grpo
    zero2 = _train(
        tmp_path / "zero2",
        *GRPO,
        *TWO,
        "actor_rollout_ref.actor.strategy=deepspeed",
        "actor_rollout_ref.actor.deepspeed_config.zero_stage=2",
    )
    _assert_same_tables(zero2, one)
    assert _weights_gap(one, zero2, 2, "actor") <= WEIGHTS_TOLERANCE


def test_deepspeed_zero3_actor_and_zero2_critic(one_small_ppo, tmp_path):
    """PPO with the actor under ZeRO-3 and the critic under ZeRO-2: the first iteration's tables are
    the same (the same initial weights); ZeRO-3's weights then differ in the last bits (see above)."""
    one = one_small_ppo
    sharded = _train(
        tmp_path / "zero",
        *SMALL_PPO,
        *TWO,
        "actor_rollout_ref.actor.strategy=deepspeed",
        "actor_rollout_ref.actor.deepspeed_config.zero_stage=3",
        "critic.strategy=deepspeed",
        "critic.deepspeed_config.zero_stage=2",
    )
    _assert_same_tables(sharded, one, 1)
    assert _weights_gap(one, sharded, 1, "critic") <= WEIGHTS_TOLERANCE
    assert _weights_gap(one, sharded, 2, "actor") <= WEIGHTS_TOLERANCE
    _assert_same_tables(sharded, one, names=["rewards"])
    for role in ("actor", "critic"):  # each rank wrote the moments of its own half of the parameters
        first, second = _optimizer_parts(sharded, 2, role)
        assert first and second and not first & second
        assert first | second == _optimizer_parts(one, 2, role)[0]
    _train(sharded, *SMALL_PPO, "trainer.total_training_steps=3")  # continued in one process
    assert _table(sharded, "rewards", 3)


def test_resume_on_another_world_size(one_grpo, one_small_ppo, tmp_path):
    """1 → 2 ranks (GRPO, ZeRO-2) and 2 → 1 (PPO, FSDP2): the resumed run loads the checkpoint and
    optimizer state the other world size wrote and ends where an uninterrupted run ends."""
    zero2 = [*TWO, "actor_rollout_ref.actor.strategy=deepspeed"]
    straight = one_grpo
    grown = tmp_path / "grown"
    _train(grown, *GRPO, "trainer.total_training_steps=1")
    _train(grown, *GRPO, *zero2)
    _assert_same_tables(grown, straight, names=["rollouts"])
    assert _weights_gap(straight, grown, 2, "actor") <= WEIGHTS_TOLERANCE

    straight = one_small_ppo
    shrunk = tmp_path / "shrunk"
    _train(shrunk, *SMALL_PPO, *FSDP2, "trainer.total_training_steps=1")
    _train(shrunk, *SMALL_PPO)
    for role in ("actor", "critic"):
        assert _weights_gap(straight, shrunk, 2, role) <= WEIGHTS_TOLERANCE


RUN_TAG = "PPOFLOW_TEST_RUN"
"""An environment variable that marks a command's processes: Ray's inherit it."""


def _ray_processes(tag: str) -> set[int]:
    """Ray's processes (its GCS, raylet and workers) started by a command run with RUN_TAG=`tag` in
    its environment, which they inherit: another test process's Ray, or its fakes, are not counted."""
    marker = f"{RUN_TAG}={tag}".encode()
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            command = (entry / "cmdline").read_bytes()
            if not any(word in command for word in (b"ray::", b"raylet", b"gcs_server")):
                continue
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def _run_seeing_ray(command: list[str], env: dict[str, str], tag: str, timeout_s: float = 900):
    """Run `command` to its end; returns (the finished process, every Ray process of it seen while it
    ran, looked for twice a second)."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen, deadline = set(), time.monotonic() + timeout_s
    while True:
        try:
            out, err = process.communicate(timeout=0.5)  # (reads the pipes meanwhile: none fills up)
            return subprocess.CompletedProcess(command, process.returncode, out, err), seen
        except subprocess.TimeoutExpired:
            seen |= _ray_processes(tag)
            if time.monotonic() > deadline:
                process.kill()
                raise


def test_a_killed_rank_fails_the_stage_in_seconds_and_the_rerun_resumes(fsdp2, tmp_path):
    """SIGKILL of rank 1 in the middle of step 2's actor update: the command fails within seconds
    with one line naming the rank and the stage, nothing of Ray is left, and the same command run
    again resumes to the weights of the uninterrupted run."""
    run_dir = tmp_path / "killed"
    command = [
        sys.executable,
        "-m",
        "ppoflow",
        "train",
        *COMMON,
        *FSDP2,
        f"trainer.default_local_dir={run_dir}",
    ]
    tag = str(uuid.uuid4())
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {
        "PPOFLOW_PROGRESS": "0",
        "PPOFLOW_FAULT": "actor_update_rank1@2",
        "PPOFLOW_FAULT_ONCE": str(tmp_path / "fired"),
        RUN_TAG: tag,
    }
    failed, ray = _run_seeing_ray(command, env, tag)
    assert ray, "the command's Ray processes were not seen (so their absence below would say nothing)"
    assert failed.returncode != 0
    stopped = [line for line in failed.stderr.splitlines() if line.startswith("ppoflow: training stopped")]
    assert len(stopped) == 1, failed.stderr[-3000:]
    assert stopped[0].startswith(
        "ppoflow: training stopped: worker rank 1 of 2 failed during actor_update (step 2): "
    ), stopped
    assert (tmp_path / "fired").exists()
    assert time.time() - (tmp_path / "fired").stat().st_mtime < 120  # from the kill, not Ray's start-up
    assert not list(run_dir.glob("iter=000002/actor_update/*.parquet"))
    deadline = time.monotonic() + 120
    while _ray_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ray_processes(tag)

    # 900 s: a guard against a hang, which a loaded machine's minutes for one step must not meet
    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    for role in ("actor", "critic"):
        assert _weights_gap(fsdp2, run_dir, 2, role) == 0.0  # same world size, same machine

    shutil.rmtree(run_dir)


def test_world_size_above_one_needs_a_sharding_strategy():
    from ppoflow.conf import ConfigError, load_config

    with pytest.raises(ConfigError, match="set it to fsdp2 .* or deepspeed"):
        load_config(None, [*TWO, "actor_rollout_ref.actor.strategy=torch"])
    assert load_config(None, TWO).world_size == 2  # verl's default strategy, fsdp, runs as FSDP2
    cfg = load_config(None, [*FSDP2, "algorithm.adv_estimator=grpo", "critic.strategy=torch"])
    assert cfg.world_size == 2  # the critic's strategy does not matter without a critic
