"""ppoflow the Prefect way, for real: `scripts/stack up` starts a Prefect server and a process worker
on 127.0.0.1, deploys prefect.yaml, and the tests drive it with the `prefect` CLI exactly as a user
would: `prefect deployment run`, `prefect flow-run retry`, the scheduled retrain deployment. The last
test stops the stack by process id and checks that nothing is left running."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterId,
)
from prefect.settings import PREFECT_API_URL, temporary_settings

from ppoflow.tasks.storage.confined_query import query

from .conftest import SMALL

REPO = Path(__file__).resolve().parents[2]
DETERMINISTIC = ["trainer.num_threads=1"]


@dataclass
class Stack:
    dir: Path
    env: dict[str, str]
    api: str
    up_output: str = ""

    def prefect(self, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(REPO / ".venv/bin/prefect"), *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def run_deployment(self, name: str, params: dict, job_env: dict | None = None) -> str:
        """`prefect deployment run NAME --param k=v … --watch`; returns the flow run id."""
        args = ["deployment", "run", name, "--watch", "--watch-interval", "1", "--watch-timeout", "500"]
        for key, value in params.items():
            args += ["--param", f"{key}={json.dumps(value)}"]
        if job_env:
            args += ["--job-variable", f"env={json.dumps(job_env)}"]
        out = self.prefect(*args)
        found = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout)
        assert found, out.stdout + out.stderr
        return found.group(1)

    def client(self):
        return _Client(self.api)

    def pids(self) -> dict[str, int]:
        return {p.stem: int(p.read_text()) for p in self.dir.glob("*.pid")}


class _Client:
    """A synchronous Prefect client pointed at the stack's server (not the test harness's)."""

    def __init__(self, api: str):
        self.api = api

    def __enter__(self):
        self.settings = temporary_settings(updates={PREFECT_API_URL: self.api})
        self.settings.__enter__()
        self.client = get_client(sync_client=True)
        return self.client.__enter__()

    def __exit__(self, *exc):
        self.client.__exit__(*exc)
        self.settings.__exit__(*exc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    """The documented local stack on a loopback port the kernel picks as the server binds it
    (PPOFLOW_STACK_PORT=0; never probed beforehand), with its own PREFECT_HOME. The worker
    inherits PPOFLOW_CACHE, so flow runs find the tiny base model built by the session."""
    stack_dir = tmp_path_factory.mktemp("stack")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {
        "PPOFLOW_STACK_DIR": str(stack_dir),
        "PPOFLOW_STACK_PORT": "0",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",  # a resumed schedule queues runs soon
    }
    up = subprocess.run(
        ["bash", "scripts/stack", "up"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    port_file = stack_dir / "port"
    port = int(port_file.read_text()) if port_file.exists() else 0
    api = f"http://127.0.0.1:{port}/api"
    client_env = env | {"PREFECT_API_URL": api, "PREFECT_HOME": str(stack_dir / "prefect-home")}
    stack = Stack(stack_dir, client_env, api, up.stdout)
    pgids = list(stack.pids().values())
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert port > 0 and f"UI            http://127.0.0.1:{port}\n" in up.stdout
        yield stack
    finally:  # a safety net: the last test stops the stack and checks it
        subprocess.run(["bash", "scripts/stack", "down"], cwd=REPO, env=env, capture_output=True, timeout=120)
        for pgid in pgids:
            if _group_alive(pgid):
                os.killpg(pgid, 9)


def _flow_run(stack: Stack, flow_run_id: str):
    with stack.client() as client:
        return client.read_flow_run(flow_run_id)


def _wait_terminal(stack: Stack, flow_run_id: str, timeout: float = 500):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = _flow_run(stack, flow_run_id)
        if run.state.is_final() and run.state.name != "AwaitingRetry":
            return run
        time.sleep(1)
    raise TimeoutError(f"flow run {flow_run_id} did not finish in {timeout} s")


def _task_runs(stack: Stack, flow_run_id: str, timeout_s: float = 120):
    """The flow run's task runs in the order they were created, once the server has recorded them
    all: it records task runs from their events, in batches, after the flow run's own state may be
    final (on a loaded machine seconds later), so wait until every one has a final state and none
    has changed for 2 s."""
    deadline, previous, unchanged_since = time.monotonic() + timeout_s, None, time.monotonic()
    while True:
        with stack.client() as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
        seen = sorted((str(r.id), r.state.name if r.state else "") for r in runs)
        if seen != previous:
            previous, unchanged_since = seen, time.monotonic()
        final = all(r.state is not None and r.state.is_final() for r in runs)
        if runs and final and time.monotonic() - unchanged_since >= 2:
            return sorted(runs, key=lambda r: r.created)
        assert time.monotonic() < deadline, f"the task runs did not settle: {seen}"
        time.sleep(0.25)


def _artifacts(stack: Stack, flow_run_id: str) -> dict[str, list]:
    with stack.client() as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    by_type: dict[str, list] = {}
    for artifact in sorted(found, key=lambda a: a.created):
        by_type.setdefault(artifact.type, []).append(artifact)
    return by_type


def _small(run_dir: Path, *extra: str) -> dict:
    return {"overrides": [*SMALL, *DETERMINISTIC, f"trainer.default_local_dir={run_dir}", *extra]}


@pytest.mark.slow
def test_deployment_run_trains_with_the_override_and_publishes_tables_and_artifacts(stack, tmp_path):
    run_dir = tmp_path / "run"
    flow_run_id = stack.run_deployment("ppo-train/default", _small(run_dir))
    assert _flow_run(stack, flow_run_id).state.name == "Completed"
    # The override took effect: 2 iterations of 32 prompts, validation before and after each.
    assert query(run_dir, "SELECT count(*), count(DISTINCT iter) FROM rollouts")[1] == [(64, 2)]
    assert query(run_dir, "SELECT list(step ORDER BY step) FROM metrics")[1] == [([0, 1, 2],)]
    assert query(run_dir, "SELECT count(DISTINCT iter) FROM validation")[1] == [(3,)]
    artifacts = _artifacts(stack, flow_run_id)
    [metrics_table] = artifacts["table"]  # one card, updated in place (not one per iteration)
    table = json.loads(metrics_table.data)
    assert [row["step"] for row in table] == [0, 1, 2]
    logged = dict(query(run_dir, 'SELECT step, "critic/score/mean" FROM metrics')[1])
    assert [row["critic/score/mean"] for row in table[1:]] == [
        pytest.approx(logged[s], rel=1e-4) for s in (1, 2)
    ]
    [progress] = artifacts["progress"]
    assert progress.data == pytest.approx(100.0)
    summary = next(a.data for a in artifacts["markdown"] if a.key.endswith("-summary"))
    assert "**Validation**" in summary and str(run_dir) in summary and "| 2 |" in summary
    assert "**Diagnose**" in summary and "**Final metrics** (iteration 2)" in summary
    links = [a.data for a in artifacts["markdown"] if a.key.endswith(("-run-dir", "-checkpoint"))]
    assert f"file://{run_dir}" in links[0] or f"file://{run_dir}" in links[1]
    assert any("checkpoints/iter=000002/actor" in link for link in links)


@pytest.mark.slow
def test_a_failed_run_retried_continues_at_the_failed_stage(stack, tmp_path):
    run_dir = tmp_path / "run"
    marker = tmp_path / "fault-fired"
    fault = {"PPOFLOW_FAULT": "actor_update@2:raise", "PPOFLOW_FAULT_ONCE": str(marker)}
    flow_run_id = stack.run_deployment("ppo-train/default", _small(run_dir), job_env=fault)
    assert _flow_run(stack, flow_run_id).state.name == "Failed" and marker.is_file()
    done = {p: p.stat().st_ino for p in run_dir.glob("iter=*/*/*.parquet")}
    assert any("iter=000002/advantages" in str(p) for p in done)
    first_attempt = {r.id for r in _task_runs(stack, flow_run_id)}

    retried = stack.prefect("flow-run", "retry", flow_run_id)
    assert retried.returncode == 0, retried.stdout + retried.stderr
    run = _wait_terminal(stack, flow_run_id)
    assert run.state.name == "Completed" and run.run_count == 2

    second = [(r.name, r.state.name) for r in _task_runs(stack, flow_run_id) if r.id not in first_attempt]
    names = [name for name, _ in second]
    failed_at = names.index("actor_update-step2")
    before, after = second[:failed_at], second[failed_at:]
    assert before and {state for _, state in before} == {"Cached"}, before
    assert {state for _, state in after} == {"Completed"}, after
    assert [n for n, _ in after if not n.startswith("metrics")] == [
        "actor_update-step2",
        "validation-step2",
    ]
    # The finished stages' files were served, not rewritten.
    assert {p: p.stat().st_ino for p in done} == done


def _nightly(stack: Stack):
    with stack.client() as client:
        deployment = client.read_deployment_by_name("retrain/nightly")
        scheduled = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        )
    return deployment, [run for run in scheduled if run.state.name == "Scheduled"]


def test_retrain_deployment_is_scheduled_paused_and_runs_through_the_worker(stack, tmp_path):
    """Deploying starts no training: the cron schedule is on the server, paused, with nothing queued,
    and `stack up` says how to turn it on; the command it prints queues runs, pausing removes them.
    A run with no new data trains nothing and says so (tests/flows/test_retrain.py covers rounds)."""
    deployment, queued = _nightly(stack)
    [schedule] = deployment.schedules
    assert schedule.schedule.cron == "0 3 * * *" and schedule.active is False and queued == []
    resume = f"prefect deployment schedule resume retrain/nightly {schedule.id}"
    assert resume in stack.up_output
    assert stack.prefect(*resume.split()[1:]).returncode == 0
    deadline = time.monotonic() + 180  # the server's scheduler queues the next runs within seconds
    while not (queued := _nightly(stack)[1]) and time.monotonic() < deadline:
        time.sleep(1)
    assert queued and all(run.expected_start_time.hour == 3 for run in queued)
    assert (
        stack.prefect("deployment", "schedule", "pause", "retrain/nightly", str(schedule.id)).returncode == 0
    )
    deployment, queued = _nightly(stack)
    assert deployment.schedules[0].active is False and queued == []
    schema = deployment.parameter_openapi_schema["properties"]
    assert "champion" in schema["iterations"]["description"] and schema["iterations"]["exclusiveMinimum"] == 0
    refused = stack.prefect("deployment", "run", "retrain/nightly", "--param", "iterations=0")
    assert refused.returncode != 0 and "iterations" in refused.stdout + refused.stderr
    incoming, root = tmp_path / "incoming", tmp_path / "retrain"
    incoming.mkdir()
    flow_run_id = stack.run_deployment("retrain/nightly", {"data_dir": str(incoming), "run_dir": str(root)})
    assert _flow_run(stack, flow_run_id).state.name == "Completed"
    said = next(a.data for a in _artifacts(stack, flow_run_id)["markdown"] if a.key.endswith("-retrain"))
    assert "no new data" in said and "nothing to train" in said
    assert not (root / "rounds").exists()
    assert query(root, "SELECT count(*) FROM promotions")[1] == [(0,)]


def test_the_ui_reaches_the_api_at_the_port_the_server_bound(stack):
    """Asked for port 0, the server tells its UI the port it bound (the UI reads /ui-settings)."""
    with urllib.request.urlopen(stack.api.removesuffix("/api") + "/ui-settings", timeout=30) as answer:
        assert json.load(answer)["api_url"] == stack.api


def _stack(command: str, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/stack", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_stack_down_stops_every_process_it_started(stack, tmp_path):
    port = urlsplit(stack.api).port  # a second stack asked for the first one's port is refused
    first = stack.pids()
    assert set(first) == {"server", "worker"} and all(_alive(p) for p in first.values())
    second = subprocess.run(
        ["bash", "scripts/stack", "up"],
        cwd=REPO,
        env=stack.env | {"PPOFLOW_STACK_DIR": str(tmp_path / "second"), "PPOFLOW_STACK_PORT": str(port)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1 and "already serves a Prefect API" in second.stderr
    # A server that died is started again (on another port: 0 asks for any) and the worker follows it.
    os.killpg(first["server"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _alive(first["server"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    again = _stack("up", stack.env)
    assert again.returncode == 0, again.stdout + again.stderr
    pids = stack.pids()
    assert pids["server"] != first["server"] and pids["worker"] != first["worker"]
    assert not _alive(first["worker"])
    new_api = f"http://127.0.0.1:{int((stack.dir / 'port').read_text())}/api"
    assert f"PREFECT_API_URL={new_api}".encode() in Path(
        f"/proc/{pids['worker']}/environ"
    ).read_bytes().split(b"\0")
    # A port file that holds no port stops `up`, and neither `status` nor `down`.
    (stack.dir / "port").write_text("4200'; x\n")
    tampered = _stack("up", stack.env, timeout=60)
    assert tampered.returncode == 1 and "port holds no port number" in tampered.stderr
    status = _stack("status", stack.env, timeout=60)
    assert status.returncode == 0 and "server running" in status.stdout
    down = subprocess.run(
        ["bash", "scripts/stack", "down"],
        cwd=REPO,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(_alive(pid) or _group_alive(pid) for pid in [*first.values(), *pids.values()])
    assert not list(stack.dir.glob("*.pid")) and not (stack.dir / "port").exists()
    assert not (stack.dir / "worker.api").exists()


def test_the_stack_refuses_a_port_that_is_not_a_number(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    for port in ("http", "-1", "65536", "4200x"):
        up = subprocess.run(
            ["bash", "scripts/stack", "up"],
            cwd=REPO,
            env=env | {"PPOFLOW_STACK_DIR": str(tmp_path / "stack"), "PPOFLOW_STACK_PORT": port},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert up.returncode == 2, (port, up.stdout, up.stderr)
        assert f"PPOFLOW_STACK_PORT={port}: expected a port number, 0 to 65535" in up.stderr
        assert not (tmp_path / "stack" / "server.pid").exists()


def test_the_stack_server_says_which_port_it_cannot_listen_on(tmp_path):
    """A port another socket listens on (this test's own, held throughout) is refused before Prefect
    starts, and no port file is written."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = subprocess.run(
            [
                sys.executable,
                "-m",
                "ppoflow.stack_server",
                "--port",
                str(port),
                "--port-file",
                str(tmp_path / "port"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert server.returncode == 1
    assert f"stack server: cannot listen on 127.0.0.1:{port}: Address already in use" in server.stderr
    assert not (tmp_path / "port").exists()


def test_the_stack_server_says_where_it_cannot_write_its_port(tmp_path):
    port_file = tmp_path / "missing" / "port"
    server = subprocess.run(
        [sys.executable, "-m", "ppoflow.stack_server", "--port", "0", "--port-file", str(port_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert server.returncode == 1
    assert f"stack server: cannot write the port to {port_file}: No such file or directory" in server.stderr
