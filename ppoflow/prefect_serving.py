"""Prefect's server app, served by uvicorn on a socket ppoflow bound itself: the temporary server of a
`ppoflow train` (ppoflow/prefect_server.py, in a process of its own) and the server of
`scripts/stack` (ppoflow/stack_server.py).

The socket is handed to uvicorn as a TCP socket object (ppoflow/listening.py: asyncio then sets
TCP_NODELAY on each connection). uvicorn's own `--fd` wraps the descriptor as a Unix socket and so
never sets it: a health check on a kept-alive connection took a median 44 ms that way, under 1 ms
this way.

    python -P -m ppoflow.prefect_serving --fd N [--log-level error]   # the temporary server's process
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

APP_FACTORY = "prefect.server.api.server:create_app"
"""Prefect's server app, made by uvicorn after it has set up its logging (as uvicorn's command line
does: Prefect's own logging setup then has the last word); create_app reads PREFECT__SERVER_* and the
other settings from the environment."""


STARTUP_LOCK = ".ppoflow-server-startup.lock"
"""In PREFECT_HOME: held while a server starts (its database migrations and block registrations).
Servers of runs started together share the home's database: eight that made a new one at once raced
its migrations, and three exited ("duplicate column name: block_type_name"). Started one after the
other, the first makes it and the others find it made."""


def serve(listener: socket.socket, *, log_level: str, app=None, **options) -> None:
    """Prefect's server on `listener` until SIGTERM or SIGINT: `app` (`prefect server start` makes
    its app first), else APP_FACTORY's. `options` go to uvicorn.Config. Its startup waits for that of
    any other server on the same Prefect home (STARTUP_LOCK)."""
    import uvicorn

    if app is None:
        config = uvicorn.Config(APP_FACTORY, factory=True, log_level=log_level, **options)
    else:
        config = uvicorn.Config(app, log_level=log_level, **options)

    class OneStartupAtATime(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            with _held(_startup_lock()):  # (blocking: nothing is served before the startup anyway)
                await super().startup(sockets=sockets)

    OneStartupAtATime(config).run(sockets=[listener])


def _startup_lock() -> Path:
    from prefect.settings import PREFECT_HOME

    home = Path(PREFECT_HOME.value()).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home / STARTUP_LOCK


@contextlib.contextmanager
def _held(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (made if need be), freed by the kernel if this process dies."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="a listening TCP socket this process inherited")
    parser.add_argument("--log-level", default="error")
    args = parser.parse_args(argv)
    listener = socket.socket(fileno=args.fd)  # family, type and proto (TCP) read from the descriptor
    serve(listener, log_level=args.log_level, lifespan="on")


if __name__ == "__main__":
    main()
