"""The Prefect server of `scripts/stack`: `prefect server start` (the API, the UI and the services)
on a socket this process binds first, so that port 0 can mean "a port the kernel picks", and the
port is written to a file before the server answers.

    python -m ppoflow.stack_server --port 0 --port-file .stack/port

Binding first is what makes port 0 safe: a port found free and bound later by the server could be
taken meanwhile by another process (a second stack, another test run), whose server would then
answer for this one.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (port 0: one the kernel picks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as `prefect server start`
        listener.bind((host.strip("[]"), port))
        listener.listen(socket.SOMAXCONN)
    except OSError as error:
        listener.close()
        raise SystemExit(f"stack server: cannot listen on {host}:{port}: {error.strerror}") from None
    return listener


def write_port(path: Path, port: int) -> None:
    """The port, written whole or not at all (a reader polls for the file)."""
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(f"{port}\n")
    staging.replace(path)


def serve(listener: socket.socket) -> None:
    """Prefect's server on `listener`, as `prefect server start` runs it in the foreground with one
    worker (its settings come from the environment: PREFECT_HOME, PREFECT_SERVER_*)."""
    import prefect
    import uvicorn
    from prefect.server.api.server import create_app
    from prefect.settings import (
        PREFECT_SERVER_API_KEEPALIVE_TIMEOUT,
        PREFECT_SERVER_API_WEBSOCKET_PING_INTERVAL,
        PREFECT_SERVER_API_WEBSOCKET_PING_TIMEOUT,
        PREFECT_SERVER_LOGGING_LEVEL,
    )

    uvicorn.run(
        app=create_app(final=True),
        app_dir=str(Path(prefect.__file__).parent.parent),
        fd=listener.fileno(),
        timeout_keep_alive=PREFECT_SERVER_API_KEEPALIVE_TIMEOUT.value(),
        ws_ping_interval=PREFECT_SERVER_API_WEBSOCKET_PING_INTERVAL.value(),
        ws_ping_timeout=PREFECT_SERVER_API_WEBSOCKET_PING_TIMEOUT.value(),
        log_level=PREFECT_SERVER_LOGGING_LEVEL.value().lower(),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0: a port the kernel picks")
    parser.add_argument("--port-file", type=Path, required=True, help="where the port is written")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: expected 0 to 65535")
    listener = listen(args.host, args.port)
    port = listener.getsockname()[1]
    try:
        write_port(args.port_file, port)
    except OSError as error:
        raise SystemExit(
            f"stack server: cannot write the port to {args.port_file}: {error.strerror}"
        ) from None
    print(f"Prefect server on http://{args.host}:{port}", flush=True)
    serve(listener)


if __name__ == "__main__":
    sys.exit(main())
