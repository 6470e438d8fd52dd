"""`ppoflow explore RUN_DIR`: serve the rollout explorer of a run on loopback until Ctrl-C.

The port is the one the system gives a socket bound to port 0 (`--port` chooses one): no port is
probed, so explorers of several runs, trainings and CI run side by side. The URL is printed with the
token the page needs (server.py). Ctrl-C (or SIGTERM) stops the server, closes the run's DuckDB
connection and leaves nothing behind: the explorer writes no file and starts no process.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

from ppoflow.explorer.connections import guarded_protocol
from ppoflow.explorer.server import explorer_app, is_loopback_host
from ppoflow.listening import tcp_listener

__all__ = ["explore", "explorer_server", "reachable_name"]


def explore(run_dir: str | Path, *, host: str, port: int, allow_remote: bool) -> int:
    if not is_loopback_host(host) and not allow_remote:
        print(
            f"ppoflow: --host {host} is not a loopback address: the explorer would show the run to the "
            "network; add --allow-remote to serve it there anyway",
            file=sys.stderr,
        )
        return 2
    try:
        # a fixed port is reused at once after a restart; 64 connections waiting to be accepted
        listener = tcp_listener(host, port, reuse_address=bool(port), backlog=64)
    except OSError as exc:
        print(f"ppoflow: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    token = secrets.token_urlsafe(24)
    remote = allow_remote and not is_loopback_host(host)  # on loopback, every check stays
    try:
        app, explorer = explorer_app(run_dir, token, allow_remote=remote, note=_note)
        explorer.open()  # a run that cannot be read is said now, not on the page
    except (ValueError, FileNotFoundError) as error:
        listener.close()
        print(f"ppoflow: {error}", file=sys.stderr)
        return 2
    bound_host, bound_port = listener.getsockname()[:2]
    if remote and bound_host in ("0.0.0.0", "::"):  # every address: one that others can reach
        bound_host = reachable_name(socket.AF_INET6 if bound_host == "::" else socket.AF_INET) or bound_host
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    if remote:
        print(
            f"ppoflow: warning: serving {run_dir} on {host}, beyond this machine; the page and its "
            "token travel unencrypted (plain HTTP)",
            file=sys.stderr,
        )
    if _open_to_others(Path(run_dir)):
        print(
            f"ppoflow explore: note: the token keeps other users of this machine out of this server only; "
            f"they can read {run_dir}'s files directly (chmod go-rwx {run_dir} keeps them to you)",
            file=sys.stderr,
        )
    print(f"ppoflow explore: {Path(run_dir)} at http://{shown}:{bound_port}/#token={token}", flush=True)
    print("press Ctrl-C to stop", flush=True)
    server = explorer_server(app, explorer.stop)
    # every step's metrics row, read while the page loads: the plots of a long run come sooner
    threading.Thread(target=_quietly, args=(explorer.prefetch,), name="ppoflow-prefetch", daemon=True).start()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops as Ctrl-C does
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:
        pass
    finally:
        explorer.close()
        listener.close()
    print("ppoflow explore: stopped", flush=True)
    return 0


def reachable_name(family: int = socket.AF_INET) -> str | None:
    """A name or address of this machine that another one can reach: its fully qualified name when
    that is not loopback (a machine whose name resolves to 127.0.0.1 printed http://localhost:PORT),
    else the address of the interface it would send from (a UDP socket's connect sends nothing);
    None when there is none."""
    name = socket.getfqdn()
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(name, None, family)}
    except OSError:
        resolved = set()
    if resolved and not any(is_loopback_host(address) for address in resolved | {name}):
        return name
    probe = socket.socket(family, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1" if family == socket.AF_INET else "2001:db8::1", 9))  # documentation
        address = probe.getsockname()[0]  # addresses: no route is asked of anyone
    except OSError:
        return None
    finally:
        probe.close()
    return None if is_loopback_host(address) or address in ("0.0.0.0", "::") else address


def _open_to_others(run_dir: Path) -> bool:
    """Whether users other than the owner can reach the run's files: every folder above it lets them
    through, and the run directory lets them in (its files are written 0644 under the usual umask)."""
    try:
        path = run_dir.resolve()
        if not path.stat().st_mode & 0o011:
            return False
        return all(folder.stat().st_mode & 0o011 for folder in path.parents)
    except OSError:
        return False


def _note(line: str) -> None:
    print(f"ppoflow explore: {line}", file=sys.stderr, flush=True)


def _quietly(read: Callable[[], None]) -> None:
    """Run `read`; what stops it (the server stopping, a run removed meanwhile) the page's own
    requests meet and say."""
    with contextlib.suppress(Exception):
        read()


def explorer_server(
    app: ASGIApp, on_exit: Callable[[], None], protocol: type[asyncio.Protocol] | None = None
) -> uvicorn.Server:
    """The explorer's uvicorn server: HTTP/1.1 only, over connections with deadlines and a bound
    that no peer can use to keep the page out (connections.py; `protocol`: other bounds)."""
    return _StoppingServer(
        uvicorn.Config(
            app,
            http=protocol or guarded_protocol(),
            log_level="error",  # not a line per malformed request from whoever can reach the port
            access_log=False,
            lifespan="off",
            server_header=False,
            ws="none",  # HTTP only
            timeout_graceful_shutdown=5,  # a request still open after Ctrl-C is cut after 5 s
        ),
        on_exit,
    )


class _StoppingServer(uvicorn.Server):
    """uvicorn's server, that also stops the run's reader when Ctrl-C or SIGTERM arrives: queries
    still waiting end at once and the running one is interrupted, so the server stops in a moment."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)
