"""The listening sockets of ppoflow's servers (the Prefect servers of ppoflow/prefect_serving.py, the
explorer), bound by ppoflow before the server runs on them: a port is a server's from the start, never
one found free and bound later.

Each is a TCP socket object whose `proto` is IPPROTO_TCP. asyncio sets TCP_NODELAY only on connections
accepted from such a socket (`base_events._set_nodelay` reads the listener's family, type and proto);
without it each response on a kept-alive connection waits for the client's delayed ACK (Nagle's
algorithm): a median 44 ms a request against under 1 ms.
"""

from __future__ import annotations

import socket


def tcp_listener(
    host: str, port: int, *, reuse_address: bool = False, backlog: int = socket.SOMAXCONN
) -> socket.socket:
    """A TCP socket listening on host:port (port 0: one the kernel picks; an IPv6 host with or without
    brackets)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if reuse_address:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host.strip("[]"), port))
        listener.listen(backlog)
    except OSError:
        listener.close()
        raise
    return listener
