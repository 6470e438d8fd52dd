"""Training runs on a real GPU (marked `gpu`: skipped without a CUDA device): the embedded default
generating with vLLM, resumed, and with transformers on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppoflow.tasks.storage.confined_query import query

pytestmark = pytest.mark.gpu


def _train(run_dir: Path, *overrides: str) -> None:
    from ppoflow.flows.train import ppo_train

    ppo_train(None, [f"trainer.default_local_dir={run_dir}", "trainer.device=cuda", *overrides])


VLLM_RUN = (
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.dtype=float32",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.2",
    "data.train_batch_size=64",
)


def _rows(run_dir: Path, sql: str) -> list[tuple]:
    return query(run_dir, sql)[1]


def test_embedded_default_trains_with_vllm_and_resumes_with_the_resumed_actor(prefect_server, tmp_path):
    """Every step's rollouts come from the actor of that step: the engine's probabilities agree with
    the trainer's recomputation at each step (stale weights would not), also after a resume."""
    pytest.importorskip("vllm", reason="needs vLLM (bash scripts/setup --gpu)")
    run_dir = tmp_path / "vllm-run"
    _train(run_dir, *VLLM_RUN, "trainer.total_training_steps=2")
    _train(run_dir, *VLLM_RUN, "trainer.total_training_steps=3")  # steps 1-2 cached, a new engine
    diffs = _rows(
        run_dir, 'SELECT iter, "training/rollout_probs_diff_max" FROM metrics WHERE iter > 0 ORDER BY iter'
    )
    assert [step for step, _ in diffs] == [1, 2, 3]
    assert all(gap < 1e-3 for _, gap in diffs), diffs
    rows = _rows(
        run_dir, "SELECT count(*), bool_and(len(rollout_log_probs) = len(response_ids)) FROM rollouts"
    )
    assert rows == [(3 * 64, True)]


def test_transformers_engine_on_cuda_trains(prefect_server, tmp_path):
    run_dir = tmp_path / "hf-cuda"
    _train(run_dir, "trainer.total_training_steps=1", "data.train_batch_size=64")
    [(memory,)] = _rows(run_dir, 'SELECT "perf/max_memory_allocated_gb" FROM metrics WHERE iter = 1')
    assert memory > 0
