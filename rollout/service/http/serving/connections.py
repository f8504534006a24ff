"""Connections that have not sent a request head: timed out, and capped, without capping working ones.

uvicorn's `limit_concurrency` counts every open connection, so 1,024 sockets that connect and send nothing answer
every request with 503 (/health included) for as long as they stay open, and nothing ever closes them. Instead, each
connection waiting for a request head (a new one, or a keep-alive one between requests) gets a deadline that data
does not extend (a slow-drip head is closed too), and only new connections that have not sent their first head are
capped: past the cap the one that waited longest is closed. A connection whose head arrived (a request being read,
run or streamed) is never counted, nor is a keep-alive one between requests, so hundreds of agent clients on one
address keep their connections while idle sockets come and go.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from rollout.service.http.serving.settings import HEAD_TIMEOUT_S, MAX_WAITING_CONNECTIONS

# Seconds a fresh connection is safe from the cap (its head may be sent and not read yet).
CAP_GRACE_S = 1.0


@dataclass
class WaitingConnections:
    """The connections of one server that wait for a request head.

    A new connection that has not sent its first request head is "fresh": fresh ones are capped (past the cap the
    oldest is closed, once it has waited `grace_s`: a burst of clients that connect at once must not push each other
    out before the server has read the heads they already sent). A keep-alive connection waiting for its next
    request is not counted (hundreds of agent clients keep theirs open), but its wait has the same deadline; an
    idle one is closed sooner by the keep-alive timeout.

    Attributes:
        head_timeout_s: the deadline of each wait (data does not extend it: a slow-drip head is closed too).
        max_fresh: most fresh connections at once.
        grace_s: a fresh connection is never pushed out by the cap before it has waited this long.
        closed_for_timeout: connections closed because their head did not come in time.
        closed_for_cap: fresh connections closed because newer ones arrived past the cap.
    """

    head_timeout_s: float = HEAD_TIMEOUT_S
    max_fresh: int = MAX_WAITING_CONNECTIONS
    grace_s: float = CAP_GRACE_S
    closed_for_timeout: int = 0
    closed_for_cap: int = 0

    def __post_init__(self) -> None:
        self._deadlines: dict[HeadDeadlineProtocol, asyncio.TimerHandle] = {}
        self._fresh: OrderedDict[HeadDeadlineProtocol, float] = OrderedDict()  # -> when it connected

    @property
    def num_fresh(self) -> int:
        """Connections that have not sent their first request head."""
        return len(self._fresh)

    def wait(self, connection: HeadDeadlineProtocol, fresh: bool) -> None:
        """`connection` starts waiting for a request head (a no-op while it already waits).

        Args:
            connection: the connection.
            fresh: it is new (counted under the cap), not a keep-alive one between requests.
        """
        if connection in self._deadlines:
            return
        loop = connection.loop
        self._deadlines[connection] = loop.call_later(self.head_timeout_s, self._timed_out, connection)
        if not fresh:
            return
        now = loop.time()
        self._fresh[connection] = now
        while len(self._fresh) > self.max_fresh:
            oldest, since = next(iter(self._fresh.items()))
            if now - since < self.grace_s:
                break  # a burst: the cap is reached again by the next connection after the grace
            self.done(oldest)
            self.closed_for_cap += 1
            oldest.close_connection()

    def done(self, connection: HeadDeadlineProtocol) -> None:
        """`connection` sent its head, or closed."""
        self._fresh.pop(connection, None)
        timer = self._deadlines.pop(connection, None)
        if timer is not None:
            timer.cancel()

    def _timed_out(self, connection: HeadDeadlineProtocol) -> None:
        if connection in self._deadlines:
            self._deadlines.pop(connection)
            self._fresh.pop(connection, None)
            self.closed_for_timeout += 1
            connection.close_connection()


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, with each wait for a request head registered in the server's `WaitingConnections`."""

    waiting: WaitingConnections  # set on the subclass `protocol_for` makes, one per server

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.waiting.wait(self, fresh=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self.waiting.done(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        # h11 leaves IDLE for the client once a request head was parsed; it is IDLE again after start_next_cycle,
        # when a keep-alive connection waits for its next request.
        if self.transport.is_closing():
            self.waiting.done(self)
        elif self.conn.their_state is h11.IDLE:
            self.waiting.wait(self, fresh=False)  # between requests (a no-op while the first head is awaited)
        else:
            self.waiting.done(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Answered before the client finished sending its body (a 413, a 408, a 401, or a body on a GET): what
        # follows would be read and dropped for as long as the client drips it, past every timeout. Close instead.
        if self.conn.their_state is h11.SEND_BODY:
            self.close_connection()

    def close_connection(self) -> None:
        """Close the connection (it sent no request head in time, or was pushed out by newer waiting ones)."""
        if not self.transport.is_closing():
            self.transport.close()


def protocol_for(waiting: WaitingConnections) -> type[HeadDeadlineProtocol]:
    """The protocol class of one server (uvicorn's `http=` setting), sharing `waiting` between its connections."""
    return type("ServerHeadDeadlineProtocol", (HeadDeadlineProtocol,), {"waiting": waiting})
