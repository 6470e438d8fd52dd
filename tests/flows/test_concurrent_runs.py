"""Several `ppoflow train` on one machine at once, each with its own temporary Prefect server: a sweep
must never wire a run to another run's server (benchmarks/concurrent_runs.py runs eight, five rounds)."""

from __future__ import annotations

import errno
import http.server
import json
import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from .conftest import SMALL

RUNS = 4
ONE_STEP = [*SMALL, "trainer.total_training_steps=1", "trainer.num_threads=1"]


def _trainer(run_dir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("PPOFLOW_FAULT", "PREFECT_API_URL")}
    return subprocess.Popen(
        [sys.executable, "-m", "ppoflow", "train", *ONE_STEP, f"trainer.default_local_dir={run_dir}"],
        env=env | {"PPOFLOW_PROGRESS": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _final_actor(run_dir: Path) -> bytes:
    return (run_dir / "checkpoints/iter=000001/actor/model.safetensors").read_bytes()


@pytest.mark.slow
def test_runs_started_together_each_train_with_a_server_of_their_own(tiny_model_dir, tmp_path):
    alone = _trainer(tmp_path / "alone")
    out, err = alone.communicate(timeout=600)
    assert alone.returncode == 0, err[-3000:]
    reference = _final_actor(tmp_path / "alone")

    trainers = [_trainer(tmp_path / f"run-{index}") for index in range(RUNS)]  # within the same second
    try:
        finished = [trainer.communicate(timeout=900) for trainer in trainers]
    finally:
        for trainer in trainers:
            if trainer.poll() is None:
                trainer.kill()
    for index, (trainer, (out, err)) in enumerate(zip(trainers, finished, strict=True)):
        run_dir = tmp_path / f"run-{index}"
        assert trainer.returncode == 0, f"run {index}: {err[-3000:]}"
        assert _final_actor(run_dir) == reference, f"run {index} trained another actor"
        server_log = (run_dir / "logs/prefect-server.log").read_text()
        assert "address already in use" not in server_log.lower(), server_log[-2000:]
        assert f"final actor     {run_dir}/checkpoints/iter=000001/actor" in out


def test_a_process_that_takes_the_port_first_cannot_answer_for_the_server(tmp_path, monkeypatch):
    """Another process (a run starting beside this one) tries to take the server's port just before
    the server starts and answers every request: it cannot bind it, and what answers is this run's
    Prefect server."""
    import ppoflow.prefect_server as prefect_server

    start = prefect_server._start
    squatters = []

    def squat_then_start(listening, output):
        port = listening if isinstance(listening, int) else listening.getsockname()[1]
        try:
            squatter = http.server.HTTPServer(("127.0.0.1", port), _AnswersEverything)
        except OSError as error:
            squatters.append(error.errno)
        else:
            threading.Thread(target=squatter.serve_forever, daemon=True).start()
            squatters.append(squatter)
        return start(listening, output)

    monkeypatch.setattr(prefect_server, "_start", squat_then_start)
    try:
        with (
            prefect_server.TemporaryServer(tmp_path / "server.log") as url,
            urllib.request.urlopen(f"{url}/admin/version", timeout=30) as answer,
        ):
            version = json.load(answer)
    finally:
        for squatter in squatters:
            if isinstance(squatter, http.server.HTTPServer):
                squatter.shutdown()
                squatter.server_close()
    import prefect

    assert squatters == [errno.EADDRINUSE]
    assert version == prefect.__version__


class _AnswersEverything(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the name http.server calls
        body = b'"not prefect"'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass
