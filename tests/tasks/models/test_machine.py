"""A run that needs what this machine lacks (a CUDA device, vLLM) stops before anything runs, in
one line that says what to install or set."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from ppoflow.tasks.models.machine import MachineUnsuitable, machine_problem, require_machine

HAS_CUDA = torch.cuda.is_available()
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_cpu_with_transformers_needs_nothing_more():
    assert machine_problem("cpu", "hf") is None
    require_machine("cpu", "hf")


def test_cuda_is_checked_against_what_torch_sees():
    problem = machine_problem("cuda", "hf")
    if HAS_CUDA:
        assert problem is None
    else:
        assert problem.startswith(f"trainer.device=cuda needs a CUDA GPU, but torch {torch.__version__} (")
        assert "sees no CUDA device" in problem and "bash scripts/setup --gpu" in problem
        assert problem.endswith("here, train with trainer.device=cpu") and "\n" not in problem
        with pytest.raises(MachineUnsuitable, match="sees no CUDA device"):
            require_machine("cuda", "hf")


def test_vllm_names_every_missing_piece():
    problem = machine_problem("cuda", "vllm")
    missing = [not HAS_CUDA, not HAS_VLLM]
    if not any(missing):
        assert problem is None
        return
    assert problem.startswith(
        "actor_rollout_ref.rollout.name=vllm with trainer.device=cuda needs a CUDA GPU and vLLM"
    )
    assert ("sees no CUDA device" in problem) == missing[0]
    assert (f"vllm is not installed in this Python ({sys.executable})" in problem) == missing[1]
    assert problem.endswith("train with actor_rollout_ref.rollout.name=hf trainer.device=cpu")


def test_ppoflow_train_stops_before_the_run_directory_exists(tmp_path):
    """No CUDA device visible (CUDA_VISIBLE_DEVICES empty, so on any machine): exit 2, one line, and
    no run directory, log or Prefect server started."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ppoflow",
            "train",
            "actor_rollout_ref.rollout.name=vllm",
            "trainer.device=cuda",
            f"trainer.default_local_dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "ppoflow: actor_rollout_ref.rollout.name=vllm with trainer.device=cuda"
    )
    assert "sees no CUDA device" in lines[0]
    assert not run_dir.exists()
