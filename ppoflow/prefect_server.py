"""The temporary Prefect API server of a `ppoflow train` that has no PREFECT_API_URL.

Prefect would start such a server itself, as a child in the trainer's process group: a Ctrl-C in
the terminal then stops the server too, and the trainer spends a minute retrying it before it can
record that the flow was interrupted; a trainer killed with SIGKILL leaves it running. This server
is the same program (uvicorn serving Prefect's API on loopback, without the UI) started in a
session of its own, so Ctrl-C reaches only the trainer, which reports to a live server and stops it
on the way out; the kernel stops it if the trainer dies without doing so (tasks/stages/processes.py).
What the server prints goes to a file (RUN_DIR/logs/prefect-server.log for `ppoflow train`), never
to the trainer's terminal: the server's own shutdown notes would follow the trainer's last line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from ppoflow.listening import tcp_listener
from ppoflow.tasks.models.processes import exit_with_parent
from ppoflow.tasks.storage.flow_runs import TEMPORARY_SERVER_ENV
from ppoflow.tasks.storage.regular_files import open_regular_file

SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
"""As Prefect starts its own temporary server: no UI."""
SERVER_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
}
"""Unless the environment says otherwise:
- no telemetry;
- task runs recorded in batches (at most a second late). Prefect's default writes each task-run
  event in a transaction of its own; with five stages an iteration that kept the server busy for
  ~40% of a core, taken from training on a 2-core machine (a GRPO iteration of the tiny model, as
  benchmarks/vs_trl.py runs it: 0.46 → 0.42 s);
- Prefect's events not stored. Storing them took ~40% of the server's CPU per task run (12.2 →
  7.5 ms in benchmarks/prefect_task_cost.py) and most of the database's growth (~140 kB per step
  of the embedded default: the events, their resources and their indexes). Flow runs, task runs,
  their states, logs and artifacts are recorded as before (the task-run recorder reads the events
  as they arrive), and automations still receive every event; a later server on the same database
  shows no events for these runs (its Events page, the event markers on a run's graph). Events
  stored earlier are trimmed to Prefect's retention period only by a server that stores events."""
STARTUP_TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
STARTUP_TIMEOUT_S = float(os.environ.get(STARTUP_TIMEOUT_SETTING, 120))


@contextlib.contextmanager
def prefect_api(*, deliver_on_exit: bool = True, server_log: Path | None = None) -> Iterator[None]:
    """The user's Prefect API when PREFECT_API_URL is set, else a temporary server of our own for
    the duration of the block (how `ppoflow train` runs a flow), which appends its output to
    `server_log` (else to a file that is removed with it). With `deliver_on_exit`, Prefect's pending
    logs and events go to the server before it stops (`ppoflow train` delivers them itself, while
    its log file still takes what Prefect prints)."""
    if os.environ.get("PREFECT_API_URL"):
        yield
        return
    if "prefect" in sys.modules:  # its settings were read at import: it would start a server of its own
        raise RuntimeError("prefect_api() must be entered before prefect is imported")
    with TemporaryServer(server_log) as url:
        os.environ["PREFECT_API_URL"] = url  # before prefect is first imported: its settings read it then
        os.environ[TEMPORARY_SERVER_ENV] = url
        try:
            yield
        finally:
            if deliver_on_exit:
                deliver_prefect_logs_and_events()
            os.environ.pop("PREFECT_API_URL", None)
            os.environ.pop(TEMPORARY_SERVER_ENV, None)


def deliver_prefect_logs_and_events(timeout_s: float = 5.0) -> None:
    """Send what Prefect's background workers still hold while the server is up (they would
    otherwise try at interpreter exit, after a temporary server has stopped, and retry for long)."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout_s)


class ServerDidNotStart(RuntimeError):
    """The temporary server never answered its health check."""


class TemporaryServer:
    """`with TemporaryServer(log_file) as api_url:` a Prefect API on 127.0.0.1 for the duration of
    the block; its output is appended to `log_file` (its folder made if need be; the file itself
    never through a link), or kept in a temporary file only long enough to quote if it fails to
    start."""

    def __init__(self, log_file: Path | None = None) -> None:
        self.log_file = log_file
        self.process: subprocess.Popen | None = None
        self.output = None
        self.url = ""

    def __enter__(self) -> str:
        self.output = _open_output(self.log_file)
        if self.log_file is not None:  # the file takes every run's server: where this one starts
            self.output.write(f"--- {time.strftime('%c')}: Prefect server of pid {os.getpid()}\n".encode())
            self.output.flush()
        try:
            return self._start()
        except BaseException:
            self.output.close()
            raise

    def _start(self) -> str:
        with _listening_socket() as listener:  # bound here and handed to the server: no other can have it
            port = listener.getsockname()[1]
            self.url = f"http://127.0.0.1:{port}/api"
            self.process = _start(listener, self.output)
        try:
            healthy = _wait_healthy(self.url, self.process)
        except BaseException:  # Ctrl-C while it starts
            self.stop()
            raise
        if healthy:
            return self.url
        exit_code = self.process.poll()
        self.stop()
        if exit_code is not None:
            failed = f"exited with code {exit_code}"
        else:
            failed = f"did not answer within {STARTUP_TIMEOUT_S:g} s ({STARTUP_TIMEOUT_SETTING})"
        said = f"its output is in {self.log_file}" if self.log_file else _last_line(self.output)
        raise ServerDidNotStart(
            f"the temporary Prefect server {failed}; {said} (or set PREFECT_API_URL to use a running server)"
        )

    def __exit__(self, *exc) -> None:
        self.stop()
        self.output.close()

    def stop(self) -> None:
        """SIGTERM (uvicorn shuts down in well under a second), SIGKILL after 5 s."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def _open_output(log_file: Path | None):
    if log_file is None:
        return tempfile.TemporaryFile()  # (read and write)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = open_regular_file(log_file, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    except OSError as error:
        raise OSError(f"cannot write the Prefect server's log {log_file}: {error.strerror}") from error
    return os.fdopen(descriptor, "a+b")


def _last_line(output) -> str:
    """The last line a server that did not start printed, for its one-line error."""
    output.flush()
    output.seek(max(0, output.seek(0, os.SEEK_END) - 4096))
    lines = [line.strip() for line in output.read().decode(errors="replace").splitlines() if line.strip()]
    return f"it said: {lines[-1][:400]}" if lines else "it printed nothing"


def _start(listener: socket.socket, output) -> subprocess.Popen:
    """uvicorn serving Prefect's API on `listener`, a socket bound and listening in this process: the
    port is the server's from the start (a free port picked here and bound by uvicorn later could be
    taken meanwhile by another run's server, whose health check would then answer for it). The
    process serves it as a TCP socket (ppoflow/prefect_serving.py: with TCP_NODELAY on each
    connection, which uvicorn's own --fd leaves off)."""
    parent = os.getpid()
    env = SERVER_DEFAULTS | {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | SERVER_ENV
    descriptor = listener.fileno()
    # -P: the installed ppoflow, not a folder of that name in the working directory
    command = [sys.executable, "-P", "-m", "ppoflow.prefect_serving", "--fd", str(descriptor)]
    return subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT,
        pass_fds=(descriptor,),
        start_new_session=True,
        preexec_fn=lambda: exit_with_parent(parent, signal.SIGKILL),
    )


@contextlib.contextmanager
def _listening_socket() -> Iterator[socket.socket]:
    """A TCP socket on a port of 127.0.0.1 that the kernel picks, listening; closed here on leaving
    (the server keeps its own copy)."""
    listener = tcp_listener("127.0.0.1", 0)
    try:
        yield listener
    finally:
        listener.close()


def _wait_healthy(url: str, process: subprocess.Popen) -> bool:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False
