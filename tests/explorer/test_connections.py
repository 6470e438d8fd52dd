"""The explorer's server under connections that never finish a request: idle sockets and request
heads sent in part, from a process without the token. A real uvicorn server on a real loopback socket
(ppoflow/explorer/command.py's), its deadlines shortened so that the test takes seconds."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from ppoflow.explorer.command import explorer_server
from ppoflow.explorer.connections import guarded_protocol
from ppoflow.explorer.server import explorer_app
from ppoflow.listening import tcp_listener

HEAD_TIMEOUT_S = 1.5


@pytest.fixture
def served(tmp_path: Path):
    """A running explorer of a run directory without steps: (port, token)."""
    (tmp_path / "config.yaml").write_text("trainer:\n  val_only: false\n")
    token = "t" * 32
    app, explorer = explorer_app(tmp_path, token)
    listener = tcp_listener("127.0.0.1", 0, backlog=64)
    protocol = guarded_protocol(head_timeout_s=HEAD_TIMEOUT_S, answer_timeout_s=5.0, max_connections=16)
    server = explorer_server(app, explorer.stop, protocol)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield listener.getsockname()[1], token
    server.should_exit = True
    thread.join(10)
    explorer.close()
    listener.close()


def ask(port: int, token: str) -> tuple[int, float]:
    """The status of the page's first call (`/api/run`, with the token) and its seconds."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/api/run", headers={"Host": f"127.0.0.1:{port}", "X-Ppoflow-Token": token})
    status = connection.getresponse().status
    connection.close()
    return status, time.perf_counter() - started


def attackers(port: int, count: int, sent: bytes) -> list[socket.socket]:
    opened = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        if sent:
            s.sendall(sent)
        opened.append(s)
    return opened


def closed_by_server(s: socket.socket) -> bool:
    s.settimeout(0.5)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


HALF_SENT = b"GET /api/run HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pp"


@pytest.mark.parametrize("sent", [b"", HALF_SENT], ids=["idle", "half-sent"])
def test_held_connections_neither_keep_the_page_out_nor_stay_open(served, sent):
    """64 idle connections, or 64 request heads left unfinished, made every request answer 503 for as
    long as they stayed open (uvicorn's limit_concurrency=64, and no deadline before a request's head).
    Now each new connection closes the longest-waiting idle ones beyond the bound, and every such
    connection is closed at its deadline."""
    port, token = served
    held = attackers(port, 64, sent)
    try:
        for _ in range(5):
            status, seconds = ask(port, token)
            assert status == 200 and seconds < 2.0, (status, seconds)
        more = attackers(port, 64, sent)  # opened after: the bound closes the oldest ones first
        held += more
        assert ask(port, token)[0] == 200
        time.sleep(HEAD_TIMEOUT_S + 0.5)
        assert all(closed_by_server(s) for s in held)
    finally:
        for s in held:
            s.close()


def test_thousands_of_connections_opened_at_once_are_closed_as_they_come(tmp_path):
    """2,000 connections opened as fast as a process can, to `ppoflow explore` itself: making room
    looked at every open connection for each new one, the explorer held 1,747 of them open, and the
    page's request waited more than 10 s behind them."""
    import re
    import subprocess
    import sys

    (tmp_path / "config.yaml").write_text("trainer:\n  val_only: false\n")
    command = [sys.executable, "-m", "ppoflow", "explore", str(tmp_path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    held = []
    try:
        port, token = re.search(r":(\d+)/#token=(\S+)", process.stdout.readline()).groups()
        held = attackers(int(port), 2000, b"")
        status, seconds = ask(int(port), token)
        assert status == 200 and seconds < 3.0, (status, seconds)
        assert len(os.listdir(f"/proc/{process.pid}/fd")) < 64 + 20  # the bound, and its own files
    finally:
        for s in held:
            s.close()
        process.kill()
        process.communicate()


def test_a_request_head_sent_a_byte_at_a_time_is_closed_at_its_deadline(served):
    """A head trickled in (slowloris) is closed once it has taken longer than the deadline, however
    often its bytes come: uvicorn's own timer stopped at the first byte."""
    port, token = served
    trickle = socket.create_connection(("127.0.0.1", port))
    trickle.settimeout(0.05)
    started, closed_after = time.monotonic(), None
    try:
        for byte in b"GET /api/run HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Long: " + b"a" * 100:
            try:
                trickle.sendall(bytes([byte]))
                if trickle.recv(1) == b"":
                    closed_after = time.monotonic() - started
            except TimeoutError:
                pass
            except OSError:
                closed_after = time.monotonic() - started
            if closed_after is not None or time.monotonic() - started > 3 * HEAD_TIMEOUT_S:
                break
            time.sleep(0.05)
        assert closed_after is not None and closed_after < HEAD_TIMEOUT_S + 1.0, closed_after
        assert ask(port, token)[0] == 200
    finally:
        trickle.close()


@pytest.mark.parametrize("mode", [0o755, 0o700])
def test_explore_says_when_the_runs_files_are_open_to_other_users(mode):
    """Run files are 0644 in 0755 folders: another user could read the parquet while the docs said the
    token keeps other users out. `explore` says so when that is the case (the token guards its server)."""
    import shutil
    import subprocess
    import sys
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="ppoflow-permissions-", dir="/tmp"))
    try:
        base.chmod(0o755)
        run = base / "run"
        run.mkdir(mode=mode)
        run.chmod(mode)
        (run / "config.yaml").write_text("trainer:\n  val_only: false\n")
        process = subprocess.Popen(
            [sys.executable, "-m", "ppoflow", "explore", str(run)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert "#token=" in process.stdout.readline()  # (the note comes before the URL)
        process.kill()
        _, err = process.communicate(timeout=30)
    finally:
        shutil.rmtree(base)
    note = (
        "ppoflow explore: note: the token keeps other users of this machine out of this server only; "
        f"they can read {run}'s files directly (chmod go-rwx {run} keeps them to you)\n"
    )
    assert err == (note if mode == 0o755 else "")


def test_allow_remote_prints_an_address_other_machines_can_reach(tmp_path):
    """On a machine whose name resolves to 127.0.0.1, `--host 0.0.0.0 --allow-remote` printed
    http://localhost:PORT, which reaches nobody but this machine."""
    import re
    import subprocess
    import sys

    from ppoflow.explorer.command import reachable_name
    from ppoflow.explorer.server import is_loopback_host

    (tmp_path / "config.yaml").write_text("trainer:\n  val_only: false\n")
    command = [
        sys.executable,
        "-m",
        "ppoflow",
        "explore",
        str(tmp_path),
        "--host",
        "0.0.0.0",
        "--allow-remote",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
    finally:
        process.kill()
        process.communicate(timeout=30)
    host = re.search(r"at http://([^/]+):\d+/#token=", line).group(1)
    assert not is_loopback_host(host) and host == (reachable_name() or "0.0.0.0")


def test_a_number_of_another_script_is_refused_as_every_other_non_number(served):
    """`iters=²` (a digit to Python's str.isdigit, not to int) answered Python's own int() error."""
    port, token = served
    for value in ("²", "٣", "1²"):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        query = f"/api/across?kind=train&prompt_id=p&iters={urllib.parse.quote(value)}"
        connection.request("GET", query, headers={"Host": f"127.0.0.1:{port}", "X-Ppoflow-Token": token})
        response = connection.getresponse()
        assert (response.status, json.loads(response.read())) == (
            400,
            {"error": "every iters must be a whole number of at most 12 digits"},
        )
