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

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HEAD_TIMEOUT_S", "ANSWER_TIMEOUT_S", "MAX_CONNECTIONS", "guarded_protocol"]

HEAD_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_S = 120.0
MAX_CONNECTIONS = 64


class _Room:
    """A server's guarded connections: how many are open, and those waiting for a request, the one
    that has waited longest first (a dict keeps insertion order): making room costs the same with ten
    connections or with thousands."""

    def __init__(self) -> None:
        self.open = 0
        self.waiting: dict[GuardedH11Protocol, None] = {}


class GuardedH11Protocol(H11Protocol):
    """One connection; the class attributes are set by `guarded_protocol`."""

    head_timeout_s = HEAD_TIMEOUT_S
    answer_timeout_s = ANSWER_TIMEOUT_S
    max_connections = MAX_CONNECTIONS

    _counted = False
    _deadline: asyncio.TimerHandle | None = None

    @property
    def _room(self) -> _Room:
        room = getattr(self.server_state, "ppoflow_room", None)
        if room is None:
            room = _Room()
            self.server_state.ppoflow_room = room  # type: ignore[attr-defined]
        return room

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._counted = True
        self._room.open += 1
        self._await_request()
        self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self in self._room.waiting and self._answering():
            del self._room.waiting[self]
            self._arm(self.answer_timeout_s)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (a pipelined request may start here)
        if not self.transport.is_closing() and not self._answering():
            self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._uncount()
        self._disarm()
        super().connection_lost(exc)

    def _answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _await_request(self) -> None:
        self._room.waiting.pop(self, None)
        self._room.waiting[self] = None  # the newest to wait
        self._arm(self.head_timeout_s)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._close)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _uncount(self) -> None:
        self._room.waiting.pop(self, None)
        if self._counted:
            self._counted = False
            self._room.open -= 1

    def _close(self) -> None:
        """Close at once (a peer that does not read would keep close() waiting to send the rest)."""
        self._uncount()
        self._disarm()
        self.transport.abort()

    def _make_room(self) -> None:
        """Close the longest-waiting connections without a request in progress, down to the bound."""
        room = self._room
        while room.open > self.max_connections and room.waiting:
            oldest = next(iter(room.waiting))
            if oldest is self:  # the others are all answering: this one stays too
                break
            oldest._close()


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
