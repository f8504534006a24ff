"""The worker's links to its clients: every reply goes out through `ClientLinks.send`, which keeps a bounded backlog
per client and notices clients that are gone.

A client is gone when a send to it fails (ZeroMQ's ROUTER_MANDATORY: its connection closed), when its backlog of
unread replies passes its caps (`reply_backlogs.py`: a client that reads, however slowly, keeps its place ahead of one
that does not read at all), or (its groups only) when it has groups in flight and has been silent for
`client_timeout_s`. Gone is noticed fast: the socket monitor reports every closed connection (by file
descriptor), and the worker probes the clients whose messages came over that descriptor (an unsolicited pong, which
clients ignore) for a second; a send to a closed connection fails at once. TCP keepalive, and a limit on how long
sent data may go unacknowledged, close connections to peers that vanished without closing them (a network
partition, a powered-off host); a peer that stops reading is dropped by the byte cap on its replies. Each loss is handled once: its groups are cancelled once and it is logged once;
replies still due to it are dropped quietly until it speaks again.

With CurveZMQ keys a routing id belongs to the key that last spoke over it (`routing_keys.py`).

No ZeroMQ (ZMTP) heartbeats: with them, libzmq 4.3.5 (pyzmq's, the latest release) aborts the whole process on an
assertion (`!_io_error`, stream_engine_base.cpp) when a heartbeat falls due on a connection that failed while its
inbound queue was full, which one client flooding requests it never reads the replies of brings about in seconds
(zeromq/libzmq issues 3937, 4364).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import zmq
from zmq.utils.monitor import recv_monitor_message

from rollout import protocol as p
from rollout.service.zmq.large_replies import ENCODE_TURN_S, Encoding, is_large, unencodable_reply
from rollout.service.zmq.reply_backlogs import ReplyBacklogs
from rollout.service.zmq.router_options import configure_router
from rollout.service.zmq.routing_keys import RoutingKeys

logger = logging.getLogger(__name__)

PROBE_WINDOW_S = 1.0  # after a connection closes, probe busy clients this long (a closed pipe may take a moment)
PROBE_EVERY_S = 0.2
FORGET_GONE_AFTER_S = 300.0
# A client lost again this soon after its last loss (replies to the messages it queued before leaving) is the same
# departure: logged and counted once.
SAME_LOSS_S = 10.0


class ClientLinks:
    """Sends replies to clients, and tracks which are alive. Serving thread only."""

    def __init__(
        self,
        socket: zmq.Socket,
        max_pending_bytes: int,
        client_timeout_s: float,
        on_lost: Callable[[bytes, str], None],
    ):
        """
        Args:
            socket: the worker's bound ROUTER socket (configured here: mandatory routing, send HWM, TCP keepalive).
            max_pending_bytes: most bytes of replies kept for a client that does not read; past it, it is dropped.
            client_timeout_s: silence after which a busy client's groups are cancelled.
            on_lost: called once per loss with (identity, reason): cancel its groups, drop its update.
        """
        self._socket = socket
        self.client_timeout_s = client_timeout_s
        self._on_lost = on_lost
        configure_router(socket)
        # Only DISCONNECTED: it is queued before the descriptor is released, so no new client can hold that descriptor
        # yet (CLOSED comes after the close, when a new connection may already reuse it).
        self.monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._last_seen: dict[bytes, float] = {}
        self._backlogs = ReplyBacklogs(
            max_pending_bytes, on_over_cap=lambda identity, reason: self.lose(identity, reason, unreachable=True)
        )
        self._gone: dict[bytes, float] = {}  # identity -> when it was lost
        # identity -> when its loss was logged and counted: the messages a client queued before it left each
        # revive it (`seen`) and lose it again; that is one loss, logged once, not one line per message.
        self._lost_at: dict[bytes, float] = {}
        self._fds: dict[bytes, int] = {}  # identity -> the descriptor its last message came over
        self._keys = RoutingKeys(FORGET_GONE_AFTER_S)
        self._suspects: dict[bytes, float] = {}  # identity -> until when to probe it (its connection closed)
        self._last_probe = 0.0
        self.num_lost = 0

    @property
    def num_clients(self) -> int:
        """Clients heard from that are not gone."""
        return len(self._last_seen)

    def pending_bytes(self) -> int:
        """Bytes of replies waiting in backlogs (safe to read from any thread)."""
        return self._backlogs.total

    @property
    def peak_pending_bytes(self) -> int:
        """Most bytes of replies that waited in backlogs at once."""
        return self._backlogs.peak

    @property
    def dropped_slow(self) -> int:
        """Clients dropped for leaving replies unread."""
        return self._backlogs.dropped_slow

    def seen(self, identity: bytes, fd: int | None = None, key: str | None = None) -> None:
        """A message came from `identity` (over descriptor `fd`, when known): it is alive (again).

        Args:
            identity: the connection's routing id.
            fd: the descriptor it came over (None: unknown).
            key: its sender's CurveZMQ key (None: keys are off); another key than its last message's means the
                routing id changed hands: the previous holder is lost.
        """
        # With keys, a closed connection's event first: it was queued before its descriptor was released, so before
        # any message over that descriptor's next connection (this one's, maybe) could be read; read after it, it
        # would take this client for the closed one (its routing id held, its replies kept back until it spoke
        # again). Without keys nothing is held: such an event only has a live client probed for a second.
        if key is not None:
            self.on_monitor_events()
        now = time.monotonic()
        if key is not None and self._keys.claim(identity, key):
            self.lose(identity, "its routing id now speaks with another key", unreachable=True)
        self._last_seen[identity] = now
        self._gone.pop(identity, None)
        if fd is not None:
            self._fds[identity] = fd

    @property
    def encoding(self) -> bool:
        """A large reply is being encoded at the head of a backlog: `flush` has work at once, whether or not a
        message comes (one behind replies ZeroMQ refused waits for them: no work until the client reads; so does one
        for a held routing id, until a message shows who holds it)."""
        return self._backlogs.encoding(skip=self._keys.held)

    def send(self, identity: bytes, message: p.Message, key: str | None = None) -> None:
        """Send a reply, or keep it in the client's backlog while ZeroMQ's queue to it is full (a large group result
        is encoded there, a few milliseconds per `flush`). Never blocks and never raises: an unencodable reply
        becomes an "internal" error reply, an unreachable client is lost.

        Args:
            identity: the connection's routing id.
            message: the reply.
            key: the CurveZMQ key it is for (a group's): dropped when another key holds the routing id now.
        """
        if identity in self._gone:
            return
        if key is not None:
            self.on_monitor_events()  # a connection closed by now holds its routing id before this reply goes
            if not self._keys.holds(identity, key):
                return
        if is_large(message):
            self._backlogs.queue_encoding(identity, Encoding(message, p.encode_steps(message)))
            return
        try:
            frames = p.encode(message)
        except Exception as error:  # noqa: BLE001 - a reply that cannot be encoded must not end the serving loop
            frames = unencodable_reply(message, error)
        frames = [identity, *frames]
        # Keep the order (nothing overtakes what already waits); a held routing id's replies wait (routing_keys.py).
        if identity in self._backlogs or identity in self._keys.held:
            self._backlogs.queue(identity, frames)
        else:
            self._try_send(identity, frames)

    def _try_send(self, identity: bytes, frames: list[bytes]) -> bool:
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:  # ZeroMQ's queue to this client is full: it reads slowly, or not at all
            self._backlogs.queue(identity, frames)
        except zmq.ZMQError as error:
            if error.errno == zmq.EHOSTUNREACH:
                self.lose(identity, "its connection is closed", unreachable=True)
            else:
                logger.error("cannot send to client %s: %s", identity.hex(), error)
        return False

    def flush(self, encode_s: float | None = ENCODE_TURN_S) -> None:
        """Send what waits in backlogs, oldest first, while ZeroMQ takes it; go on encoding large replies.

        Args:
            encode_s: most seconds spent encoding in this call (None: finish every encoding, as when closing).
        """
        ends = None if encode_s is None else time.monotonic() + encode_s
        self._backlogs.drain(self._sent, skip=self._keys.held, ends=ends)

    def _sent(self, identity: bytes, frames: list[bytes]) -> bool:
        """Whether ZeroMQ took `frames` now (a closed connection loses the client)."""
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError:
            self.lose(identity, "its connection is closed", unreachable=True)
            return False

    def unreachable(self, identity: bytes) -> bool:
        """Whether `identity` was lost as unreachable (its connection closed, or it left too much unread) and has not
        spoken since; a client lost for its silence is not (it may still be connected)."""
        return identity in self._gone

    def lose(self, identity: bytes, reason: str, unreachable: bool) -> None:
        """Handle a lost client once: log, forget its backlog, and let the worker cancel its groups.

        Args:
            identity: the client.
            reason: why, for the log.
            unreachable: replies to it are dropped from now on (until it speaks again); a merely silent client
                still gets the results of its cancelled groups.
        """
        if identity in self._gone:
            return
        now = time.monotonic()
        if now - self._lost_at.get(identity, -SAME_LOSS_S) >= SAME_LOSS_S:
            logger.warning("client %s is gone (%s); cancelling its groups", identity.hex(), reason)
            self.num_lost += 1
        self._lost_at[identity] = now
        self._last_seen.pop(identity, None)
        self._fds.pop(identity, None)
        self._suspects.pop(identity, None)
        self._keys.drop(identity)
        dropped = self._backlogs.pop(identity)
        if not unreachable:  # results made before it fell silent: they go out as they would have
            self._backlogs.keep_encodings(identity, dropped)
        if unreachable:
            self._gone[identity] = time.monotonic()
        self._on_lost(identity, reason)

    def on_monitor_events(self) -> None:
        """Read the socket monitor: the clients of a closed connection are probed for a while."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            fd = int(event["value"])
            until = time.monotonic() + PROBE_WINDOW_S
            for identity in [i for i, known in self._fds.items() if known == fd]:
                self._suspects[identity] = until
                self._keys.hold(identity)

    def watch(self, busy: Iterable[bytes], probe: p.Message, updating: Iterable[bytes] = ()) -> None:
        """Once per loop: expire silent busy clients, probe watched ones after a closed connection, forget old losses.

        Args:
            busy: identities of the clients with groups in flight (watched for silence and closed connections).
            probe: the message to probe them with (an unsolicited pong, which clients ignore).
            updating: the owner of the open weight update: watched for a closed connection only (its update's own
                phase deadline, `timeout_s`, bounds its silence; `client_timeout_s` dropped it sooner).
        """
        now = time.monotonic()
        busy = set(busy)
        watched = busy.union(updating)
        for identity in [i for i in self._last_seen if i not in watched and i not in self._backlogs]:
            del self._last_seen[identity]
            self._fds.pop(identity, None)
        for identity in busy:
            seen = self._last_seen.setdefault(identity, now)
            if now - seen > self.client_timeout_s:
                self.lose(identity, f"silent for {self.client_timeout_s:g} s", unreachable=False)
        if self._suspects and now - self._last_probe >= PROBE_EVERY_S:
            self._last_probe = now
            for identity, until in list(self._suspects.items()):
                if now > until or identity not in watched:
                    del self._suspects[identity]
                elif identity in self._keys.held:  # past its held replies: a gone connection is lost at once
                    self._probe(identity, probe)
                elif identity not in self._backlogs:
                    self.send(identity, probe)
        self._keys.forget_idle(watched)
        for identity in [i for i, when in self._gone.items() if now - when > FORGET_GONE_AFTER_S]:
            del self._gone[identity]
        for identity in [i for i, when in self._lost_at.items() if now - when > SAME_LOSS_S]:
            del self._lost_at[identity]

    def _probe(self, identity: bytes, probe: p.Message) -> None:
        """Send `probe` now, ahead of any backlog (clients ignore it): a vanished connection loses the client."""
        try:
            self._socket.send_multipart([identity, *p.encode(probe)], zmq.NOBLOCK)
        except zmq.Again:
            pass  # its queue is full: a connection is there
        except zmq.ZMQError as error:
            if error.errno == zmq.EHOSTUNREACH:
                self.lose(identity, "its connection is closed", unreachable=True)

    def close(self) -> None:
        """Stop the socket monitor (before the socket closes) and drop the replies still waiting."""
        self._backlogs.close()
        try:
            self._socket.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
