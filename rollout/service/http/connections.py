"""Connections that have not sent a request head: timed out, and capped, without capping working ones.

uvicorn's `limit_concurrency` counts every open connection, so 1,024 sockets that connect and send nothing answer
every request with 503 (/health included) for as long as they stay open, and nothing ever closes them. Instead, each
connection waiting for a request head (a new one, or a keep-alive one between requests) gets a deadline that data
does not extend (a slow-drip head is closed too), and only those connections are capped: past the cap the one that
waited longest is closed. A connection whose head arrived (a request being read, run or streamed) is never counted,
so hundreds of agent clients on one address keep their keep-alive connections while idle sockets come and go.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from rollout.service.http.settings import HEAD_TIMEOUT_S, MAX_WAITING_CONNECTIONS


@dataclass
class WaitingConnections:
    """The connections of one server that wait for a request head, oldest first.

    Attributes:
        head_timeout_s: the deadline of each wait.
        max_waiting: most waiting at once.
        closed_for_timeout: connections closed because their head did not come in time.
        closed_for_cap: connections closed because newer ones arrived past the cap.
    """

    head_timeout_s: float = HEAD_TIMEOUT_S
    max_waiting: int = MAX_WAITING_CONNECTIONS
    closed_for_timeout: int = 0
    closed_for_cap: int = 0

    def __post_init__(self) -> None:
        self._waiting: OrderedDict[HeadDeadlineProtocol, asyncio.TimerHandle] = OrderedDict()

    def __len__(self) -> int:
        return len(self._waiting)

    def wait(self, connection: HeadDeadlineProtocol) -> None:
        """`connection` starts waiting for a request head (a no-op while it already waits)."""
        if connection in self._waiting:
            return
        self._waiting[connection] = connection.loop.call_later(self.head_timeout_s, self._timed_out, connection)
        while len(self._waiting) > self.max_waiting:
            oldest, timer = self._waiting.popitem(last=False)
            timer.cancel()
            self.closed_for_cap += 1
            oldest.close_connection()

    def done(self, connection: HeadDeadlineProtocol) -> None:
        """`connection` sent its head, or closed."""
        timer = self._waiting.pop(connection, None)
        if timer is not None:
            timer.cancel()

    def _timed_out(self, connection: HeadDeadlineProtocol) -> None:
        if self._waiting.pop(connection, None) is not None:
            self.closed_for_timeout += 1
            connection.close_connection()


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, with each wait for a request head registered in the server's `WaitingConnections`."""

    waiting: WaitingConnections  # set on the subclass `protocol_for` makes, one per server

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.waiting.wait(self)

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
            self.waiting.wait(self)
        else:
            self.waiting.done(self)

    def close_connection(self) -> None:
        """Close the connection (it sent no request head in time, or was pushed out by newer waiting ones)."""
        if not self.transport.is_closing():
            self.transport.close()


def protocol_for(waiting: WaitingConnections) -> type[HeadDeadlineProtocol]:
    """The protocol class of one server (uvicorn's `http=` setting), sharing `waiting` between its connections."""
    return type("ServerHeadDeadlineProtocol", (HeadDeadlineProtocol,), {"waiting": waiting})
