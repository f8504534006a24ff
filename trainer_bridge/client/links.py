"""A client's link to one worker: its DEALER socket (optionally CurveZMQ), the socket monitor that reports a refused
key at once, and what the I/O thread knows of the worker (answered, alive, outstanding work, policy version)."""

from __future__ import annotations

import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from rollout.protocol.auth import secure_client_socket
from rollout.protocol.sockets import is_ipv6_literal

# Socket monitor events that mean a worker refused this client (a key it does not accept, or no key where it wants
# one): reported at once instead of waiting out the connect deadline.
UNKNOWN_VERSION = -1  # a reconnecting worker's policy version until its first pong: below every pushed version
_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
# A CURVE worker that cannot decrypt this client's greeting (a server_public_key that is not its key) closes the
# connection without a word: the client sees only a handshake cut short. A worker dying mid-handshake looks the same,
# so this is no refusal, only the likely reason given when the worker never answers.
_HANDSHAKE_CUT = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
UNVERIFIED = "cut the CurveZMQ handshake short: is server_public_key that worker's public .key file?"
# A closed connection: the worker died or restarted, or dropped this client (its groups are gone there).
_MONITORED = _HANDSHAKE_FAILURES | _HANDSHAKE_CUT | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED


class WorkerLink:
    """One worker as the client sees it: its socket, liveness and outstanding work."""

    def __init__(self, context: zmq.Context, address: str, keys: tuple[Any, Any] | None):
        self.address = address
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # No send high-water mark: messages for a worker not up yet wait in this client instead of being refused
        # (a refused send would lose the group); the client's own calls bound what waits.
        self.socket.setsockopt(zmq.SNDHWM, 0)
        # No receive high-water mark either: ZeroMQ's I/O thread always reads, so replies never wait in the worker
        # while this process is slow to take them (a worker drops a peer whose unread replies pass its byte cap).
        self.socket.setsockopt(zmq.RCVHWM, 0)
        if is_ipv6_literal(address):  # tcp://[::1]:5555; only then (localhost would try ::1 alone where hosts say so)
            self.socket.setsockopt(zmq.IPV6, 1)
        try:
            if keys is not None:
                secure_client_socket(self.socket, *keys)
            self.monitor = self.socket.get_monitor_socket(_MONITORED)
        except BaseException:
            self.socket.close(linger=0)
            raise
        try:
            self.socket.connect(address)
        except BaseException:  # an address ZeroMQ refuses (e.g. port "*"): nothing may stay open
            self.close()
            raise
        self.added_at = time.monotonic()  # its connect_timeout counts from here
        # Groups only go to a worker that answered: one that is not up yet (or a wrong address) gets pings only,
        # so nothing queued for it can reach it twice (once queued, once resubmitted) when it comes up.
        self.alive = False
        self.answered = False  # ever
        self.refused: str | None = None  # why the worker refused this client's connection (its key), if it did
        self.curve = keys is not None
        # Set when a CURVE handshake was cut short and the worker has not answered since (`UNVERIFIED`): the likely
        # reason it never answers, named in "never answered" and in the calls' errors.
        self.unverified: str | None = None
        self.warned = False  # "never answered" was logged
        self.connected = False  # a connection is up (handshake done); a worker that answered is alive soon after
        self.silent = False  # declared dead for not answering pings over a connection that is still up (frozen)
        self.lost: tuple[str, float] | None = None  # (why, when: monotonic) it was declared dead, until it answers
        self.last_ping = 0.0
        self.unanswered_since: float | None = None  # first ping sent since the worker was last heard from
        self.outstanding = 0  # tokens still to generate for groups in flight
        self.policy_version = 0  # as of the worker's last pong or weight commit (UNKNOWN_VERSION: reconnecting)
        self.taken_away: set[str] = set()  # groups resubmitted elsewhere while this worker was dead
        self.retired = False  # removed from the client (RolloutClient.remove_worker): its socket is closed

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket and its monitor (messages still queued get `linger_ms` to go out)."""
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=linger_ms)

    def monitor_events(self) -> list[tuple[str, str | None]]:
        """What the socket monitor reported since the last call, oldest first: ("connected", None) after a
        handshake, ("disconnected", None) when the connection closed, ("refused", why) when the worker refused
        this client's key or security mechanism, ("unverified", why) when a CURVE handshake was cut short (a wrong
        server key, or the worker died mid-handshake)."""
        events: list[tuple[str, str | None]] = []
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return events
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                events.append(("connected", None))
            elif event == zmq.EVENT_DISCONNECTED:
                events.append(("disconnected", None))
            elif event == _HANDSHAKE_CUT:
                if self.curve:  # (without keys a handshake cut short says nothing of keys)
                    events.append(("unverified", UNVERIFIED))
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                events.append(("refused", "refused this client's key (not among its --authorized-keys/--trainer-keys)"))
            else:
                reason = "the security handshake failed (do both sides use CurveZMQ keys, and the right server key?)"
                events.append(("refused", reason))
