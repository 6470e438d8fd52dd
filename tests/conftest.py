"""Shared fixtures: a private ppoflow cache, the warm-started tiny model, a Prefect test server; each
test process's own Prefect home; the order modules are handed out in (pytest -n)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if "PPOFLOW_CACHE" not in os.environ:  # a private cache, removed when the session ends (made by
    # pytest's first process, which the test processes of pytest -n inherit it from: they share it)
    _PRIVATE_CACHE = tempfile.TemporaryDirectory(prefix="ppoflow-cache-", ignore_cleanup_errors=True)
    os.environ["PPOFLOW_CACHE"] = _PRIVATE_CACHE.name
# Prefect's home (its profiles, its database) is this process's own, never the user's: test processes
# running side by side (pytest -n) each have one.
_PREFECT_HOME = tempfile.TemporaryDirectory(prefix="prefect-home-", ignore_cleanup_errors=True)
os.environ["PREFECT_HOME"] = _PREFECT_HOME.name
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(int(os.environ.get("PPOFLOW_NUM_THREADS", "1")))

GSM8K_DIR = Path(__file__).resolve().parents[1] / "data/gsm8k"
"""The real GSM8K JSONL files the project ships (data/gsm8k/)."""


def gsm8k_file(name: str) -> Path:
    return GSM8K_DIR / name


def try_lock(run_dir) -> bool:
    """Whether another process can take the run's lock (this one may hold it: the lock is re-entrant)."""
    code = (
        "import sys; from ppoflow.tasks.storage.lock import acquire_run_lock; acquire_run_lock(sys.argv[1])"
    )
    return subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The warm-started tiny addition model (HF directory with tokenizer), built once per session
    exactly as `ppoflow train` builds it."""
    from ppoflow.tasks.stages.prepare_model import build_tiny_base

    return build_tiny_base(seed=1)


@pytest.fixture(scope="session")
def tied_tiny_model_dir(tmp_path_factory):
    """The tiny model with its output head tied to its embedding, as SmolLM2's and the calculator
    model's are (the embedded default's is not), freshly initialised: for the paths a tied head takes."""
    from ppoflow.engine.tiny import build_tiny_model, build_tiny_tokenizer

    directory = tmp_path_factory.mktemp("tied-tiny-model")
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer, seed=1, tie_embeddings=True).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real (temporary) Prefect API server for flow tests, with its own PREFECT_HOME."""
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def pytest_collection_modifyitems(config, items):
    """Modules with `slow` tests run first, each module's tests in their own order: pytest -n hands
    out whole modules (--dist loadfile), and the long ones started last would leave one process
    working alone at the end.

    Tests marked `gpu` need a CUDA device (and those of the vLLM engine, vLLM): on a machine
    without one they are reported as skipped, with the reason."""
    slow_modules = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_modules)  # stable: the order within a module stays
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (on a GPU machine: bash benchmarks/gpu_proof.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
