"""How the worker's ROUTER socket is set up to notice lost clients: mandatory routing (a send to a closed connection
fails at once), a bounded send queue per client (past it the reply waits in `ClientLinks`' byte-counted backlog),
and TCP keepalive with a limit on unacknowledged data (not ZeroMQ heartbeats: clients.py says why)."""

from __future__ import annotations

import zmq

# Replies ZeroMQ may queue per client before they wait in our own (byte-counted) backlog.
SEND_HWM = 256
# TCP keepalive: a connection idle this many seconds is probed every KEEPALIVE_INTERVAL_S, and closed after
# KEEPALIVE_PROBES unanswered probes (a vanished host: about 20 s). Keepalive waits while sent data is
# unacknowledged (a busy client's host died mid-reply): TCP_MAXRT (TCP_USER_TIMEOUT) closes such a connection once
# its data has gone unacknowledged that long, instead of after minutes of retransmissions.
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_PROBES = 5
UNACKNOWLEDGED_MS = 20_000


def configure_router(socket: zmq.Socket) -> None:
    """Set the options above on the worker's ROUTER socket (before it binds).

    Args:
        socket: the worker's ROUTER socket.
    """
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished client raises instead of dropping
    socket.setsockopt(zmq.SNDHWM, SEND_HWM)  # past it: EAGAIN, and the reply waits in our backlog
    socket.setsockopt(zmq.TCP_KEEPALIVE, 1)
    socket.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    socket.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
    socket.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
    socket.setsockopt(zmq.TCP_MAXRT, UNACKNOWLEDGED_MS)
