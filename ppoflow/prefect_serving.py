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
import socket

APP_FACTORY = "prefect.server.api.server:create_app"
"""Prefect's server app, made by uvicorn after it has set up its logging (as uvicorn's command line
does: Prefect's own logging setup then has the last word); create_app reads PREFECT__SERVER_* and the
other settings from the environment."""


def serve(listener: socket.socket, *, log_level: str, app=None, **options) -> None:
    """Prefect's server on `listener` until SIGTERM or SIGINT: `app` (`prefect server start` makes
    its app first), else APP_FACTORY's. `options` go to uvicorn.Config."""
    import uvicorn

    if app is None:
        config = uvicorn.Config(APP_FACTORY, factory=True, log_level=log_level, **options)
    else:
        config = uvicorn.Config(app, log_level=log_level, **options)
    uvicorn.Server(config).run(sockets=[listener])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="a listening TCP socket this process inherited")
    parser.add_argument("--log-level", default="error")
    args = parser.parse_args(argv)
    listener = socket.socket(fileno=args.fd)  # family, type and proto (TCP) read from the descriptor
    serve(listener, log_level=args.log_level, lifespan="on")


if __name__ == "__main__":
    main()
