"""The explorer's HTTP connections: uvicorn's h11 protocol with deadlines, and a bound on open
connections that no peer can use to starve the page.

Anyone on the machine can connect to the explorer's loopback port, token or not. uvicorn alone gives
a connection that never sends a request no deadline (its keep-alive timer starts only after an
answer, and stops at the first byte of the next request), and its `limit_concurrency` answers 503 to
every request once that many connections are open: 64 idle sockets, or 64 request heads sent a byte
at a time, from any local process kept the page out for as long as they stayed open. Here:

- a connection must send a whole request head within `head_timeout_s` of opening, or of its last
  answer: an idle or half-sent one is closed then;
- a request must be answered, and its answer taken by the peer, within `answer_timeout_s`: a peer
  that stops reading is closed then;
- when more than `max_connections` are open, a new connection closes the ones that have waited
  longest without a request in progress (idle or half-sent), never one being answered: a connection
  that sends its request at once, as the page's do, is always served. There is no 503.
"""

from __future__ import annotations

import asyncio
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HEAD_TIMEOUT_S", "ANSWER_TIMEOUT_S", "MAX_CONNECTIONS", "guarded_protocol"]

HEAD_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_S = 120.0
MAX_CONNECTIONS = 64


class GuardedH11Protocol(H11Protocol):
    """One connection; the class attributes are set by `guarded_protocol`."""

    head_timeout_s = HEAD_TIMEOUT_S
    answer_timeout_s = ANSWER_TIMEOUT_S
    max_connections = MAX_CONNECTIONS

    _waiting_since: float | None = None
    """When it began to wait for a request head; None while a request is in progress."""
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_request()
        self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting_since is not None and self._answering():
            self._waiting_since = None
            self._arm(self.answer_timeout_s)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (a pipelined request may start here)
        if not self.transport.is_closing() and not self._answering():
            self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _await_request(self) -> None:
        self._waiting_since = time.monotonic()
        self._arm(self.head_timeout_s)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        self.transport.abort()  # (close() would wait for a peer that does not read to take the rest)

    def _make_room(self) -> None:
        """Close the longest-waiting connections without a request in progress, down to the bound."""
        others = [
            c
            for c in self.connections
            if isinstance(c, GuardedH11Protocol) and c is not self and not c.transport.is_closing()
        ]
        excess = len(others) + 1 - self.max_connections
        if excess <= 0:
            return
        waiting = sorted((c for c in others if c._waiting_since is not None), key=lambda c: c._waiting_since)
        for connection in waiting[:excess]:
            connection._disarm()
            connection.transport.abort()


def guarded_protocol(
    *,
    head_timeout_s: float = HEAD_TIMEOUT_S,
    answer_timeout_s: float = ANSWER_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn's `http` setting, with these bounds."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {
            "head_timeout_s": head_timeout_s,
            "answer_timeout_s": answer_timeout_s,
            "max_connections": max_connections,
        },
    )
