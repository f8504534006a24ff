"""The rollout worker: a ZeroMQ ROUTER socket in front of a `ContinuousBatchingManager`.

Threads: the serving thread alone owns the socket (receives, answers, sends); the manager's engine thread turns
outputs into messages and leaves them in an outbox that the serving thread drains. Neither waits on the other: the
engine never blocks on I/O, and a slow engine never stalls `ping` or `stats`.

Group ids are per client: the engine sees "<client identity>/<group id>", so two trainers may both send group "0".
A client that is gone (clients.py: its connection closed, it stopped reading, or it has groups in flight and went
silent) has its groups cancelled, which frees their KV blocks. Groups are admitted and answered by the group desk
(group_desk.py; a structured-output constraint is compiled off this loop); weight updates go through one slot
(`rollout.service.weights.update_slot`), adapter unloads beside it (`adapter_unloads.py` there); what the worker says
about itself is worker_report.py's.

Per-message work on the serving thread is bounded: headers are decoded under the limits of `WorkerLimits` (list
lengths checked before elements), and everything a message raises becomes an error reply to it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

import zmq

from rollout import protocol as p
from rollout.engine.manager.continuous_batching import ContinuousBatchingManager
from rollout.protocol.auth import SecurityLog, WorkerAuth
from rollout.protocol.sockets import (
    MessageReader,
    Waker,
    bound_ipc_file,
    frame_fd,
    frame_property,
    is_ipv6_literal,
    remove_ipc_file,
)
from rollout.service.compile.constraint_compiles import ConstraintCompiles
from rollout.service.group_counters import GroupCounters
from rollout.service.observability.tracing import Tracer
from rollout.service.weights.adapter_unloads import AdapterUnloads
from rollout.service.weights.update_slot import WEIGHT_MESSAGES, UpdateSlot
from rollout.service.zmq.clients import ClientLinks
from rollout.service.zmq.group_desk import GroupDesk
from rollout.service.zmq.limits import WorkerLimits
from rollout.service.zmq.message_checks import MessageChecks
from rollout.service.zmq.worker_report import hello_reply, worker_stats

logger = logging.getLogger(__name__)

MAX_PIECES = 1 << 16  # pieces in one weight bucket
RECEIVE_TURN = 1000  # messages read in one turn of the serving loop at most ...
RECEIVE_TURN_S = 0.010  # ... and for at most this long (then replies go out, and clients are watched)
MAX_TENSORS = 1 << 16  # tensors in one weight update


class RolloutWorker:
    """Serves one manager on one ROUTER socket."""

    def __init__(
        self,
        manager: ContinuousBatchingManager,
        bind: str,
        model_name: str,
        limits: WorkerLimits | None = None,
        keep_staging: bool = True,
        auth: WorkerAuth | None = None,
        check_finite: bool = False,
        tracer: Tracer | None = None,
        tokenizer_name: str | None = None,
    ):
        """
        Args:
            manager: the engine manager (started by `serve`).
            bind: ZeroMQ address to bind, e.g. "tcp://127.0.0.1:5555".
            model_name: what `hello` reports.
            limits: what one client may ask (message size, prompt length, n, groups, unread bytes, update
                deadlines, silence); the defaults of `WorkerLimits` when None.
            keep_staging: keep a weight update's host staging area (and shared segment) for the next update instead
                of freeing it: faster updates for one update-sized host buffer held between them.
            auth: CurveZMQ keys and roles (auth.py; built on this worker's context, see `context`); None: no
                authentication, everyone who can reach the address is a trainer.
            check_finite: refuse a weight update holding NaN or Inf (a full pass over the staged bytes at commit).
            tracer: where group and weight-update spans go (default: OpenTelemetry's global tracer provider).
            tokenizer_name: where the engine's tokenizer came from, as `hello` and `stats` report it (None: none).
        """
        self.tokenizer_name = tokenizer_name
        self.manager = manager
        self.model_name = model_name
        self.limits = limits or WorkerLimits()
        engine = manager.engine
        self.max_prompt_len = min(self.limits.max_prompt_len or engine.max_model_len, engine.max_model_len)
        # Long lists are refused from their length, before their items are looked at.
        self._max_lengths = {"prompt_ids": self.max_prompt_len, "pieces": MAX_PIECES, "tensors": MAX_TENSORS}
        self._context = auth.context if auth is not None else zmq.Context()
        # Every socket lingers 0 unless its close says otherwise (the ROUTER's does: its last results go out), libzmq's
        # own monitor socket included: with events pending for a monitor closed first, `term()` may otherwise block
        # for ever, and a worker that was asked to stop would never exit.
        self._context.set(zmq.BLOCKY, False)
        self._auth = auth
        self._socket = self._context.socket(zmq.ROUTER)
        if auth is not None:
            auth.secure(self._socket)
        self._socket.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)  # per frame; larger drops the link
        self._socket.setsockopt(zmq.LINGER, 0)
        if is_ipv6_literal(bind):  # tcp://[::1]:5555; only then (localhost would bind ::1 alone where hosts say so)
            self._socket.setsockopt(zmq.IPV6, 1)
        # Helpers call back through a weak proxy: a bound method would put the worker (manager, model, staging) in
        # a reference cycle that only a garbage collection frees.
        owner, limits = weakref.proxy(self), self.limits
        lost = lambda identity, reason: owner._client_lost(identity, reason)  # noqa: E731 - one callback, named
        self._links = ClientLinks(self._socket, limits.max_pending_bytes, limits.client_timeout_s, lost)
        try:
            self._socket.bind(bind)
        except zmq.ZMQError:  # e.g. the address was taken since it was checked: nothing of this worker stays open
            self._links.close()
            self._socket.close(linger=0)
            if auth is not None:
                auth.stop()
            self._context.term()
            raise
        # One weight bucket's frames (a header and one frame per piece) are the most a message may hold.
        self._reader = MessageReader(
            self._socket, 1 + MAX_PIECES, self.limits.max_message_bytes, max_header_bytes=p.MAX_HEADER_BYTES
        )
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ipc_file = bound_ipc_file(self.address)  # an ipc:// path's socket file, removed once released
        # The engine thread writes a byte here after filling the groups' outbox, waking the serving thread's poll
        # (no busy polling, which would steal the GIL from the engine).
        self._waker = Waker()
        self._stop = threading.Event()
        self._state_lock = threading.Lock()
        self._state = "built"  # then "serving" (serve) and "closed" (once released)
        self._tracer = tracer or Tracer()
        # Counters (stats(), /metrics), shared with the HTTP front end.
        self.counters = GroupCounters()
        # Structured-output compiles: in turn between clients, within the compile budget; shared with the HTTP
        # front end (`compiles`), whose clients take turns with these.
        self.compiles = ConstraintCompiles(engine.intake, self.limits.compile_budget())
        self._desk = GroupDesk(manager, self.limits, self.counters, self._tracer, self._waker.wake, self.compiles)
        self._updates = UpdateSlot(
            manager,
            lambda identity, message, key=None: owner._send(identity, message, key),
            self._waker.wake,
            self.limits.max_update_phase_s,
            tracer=self._tracer,
            keep_staging=keep_staging,
            check_finite=check_finite,
        )
        self._unloads = AdapterUnloads(
            manager, lambda identity, message, key=None: owner._send(identity, message, key), self._waker.wake
        )
        self._checks = MessageChecks(
            self._max_lengths,
            auth,
            self._updates,
            lambda identity, message, key=None: owner._send(identity, message, key),
            SecurityLog(logger),
            self.counters.group_refused,
        )

    @property
    def policy_version(self) -> int:
        """The version of the weights being served."""
        return self.manager.engine.policy_version

    @property
    def base_id(self) -> str | None:
        """The base weights served, as the last whole update named them (None: unnamed, e.g. as loaded at start)."""
        return self._updates.base.base_id

    # ---- serving loop -----------------------------------------------------------------------------------------
    def update_committed(self, directory: str, nbytes: int, pause_ms: float) -> None:
        """Weights were committed outside a ZeroMQ update (the HTTP API's /update_weights from a checkpoint
        directory): counted with the others (`weight_update_bytes`, `weight_update_pause_ms`), and the base is now
        named `directory`, so adapter pushes made for the weights before are refused (`BaseMismatch`)."""
        self._updates.base.set(directory)
        self._updates.counts.committed(nbytes, pause_ms)

    def update_refused(self) -> None:
        """A weight update was refused outside ZeroMQ (the HTTP API's /update_weights): counted with the others."""
        self._updates.counts.refused()

    def take_update_turn(self, directory: str) -> str | None:
        """Hold the worker's one weight-update slot for an update from `directory` outside ZeroMQ (the HTTP API's
        /update_weights), until `end_update_turn`; returns why not instead when a ZeroMQ update is open."""
        return self._updates.turn.take_outside(directory, lambda: self._updates.update)

    def end_update_turn(self) -> None:
        """Free the slot `take_update_turn` held."""
        self._updates.turn.end_outside()

    def serve(self) -> None:
        """Start the engine and serve until `shutdown()`; then abort what is in flight, tell its clients and release
        everything the worker holds (as `close`). A worker serves once.

        Raises:
            RuntimeError: the worker was closed, or already served.
        """
        with self._state_lock:
            if self._state != "built":
                raise RuntimeError(f"this worker cannot serve: it is {self._state} (build a new RolloutWorker)")
            self._state = "serving"
        try:
            self.manager.start()
            self._serve_loop()
        finally:
            self._release()

    def _serve_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._waker.reader, zmq.POLLIN)
        poller.register(self._links.monitor, zmq.POLLIN)
        while not self._stop.is_set() and self.manager.is_running():
            # No wait while a message is part read or a large reply is part encoded: both go on at once.
            ready = dict(poller.poll(0 if self._reader.busy or self._links.encoding else 100))
            # Closed connections first: their descriptors may already serve new clients whose messages wait
            # on the socket (a closed connection's event is queued before its descriptor is released).
            if self._links.monitor in ready:
                self._links.on_monitor_events()
            if self._socket in ready or self._reader.busy:
                self._receive_all()
            if ready:
                self._waker.drain()
            self._desk.admit_compiled(self._send)  # after the drain: a compile finished since wakes the next poll
            self._updates.conclude()
            self._unloads.conclude()
            self._desk.flush(self._send)
            self._links.flush()
            self._links.watch(self._desk.identities(), p.Pong(p.PROBE_NONCE, self.policy_version), self._updating())
            self._updates.expire(time.monotonic())

    def close(self) -> None:
        """Release a worker that is not serving: its compile processes, engine thread, weight staging, socket and
        ZeroMQ context (e.g. one built in-process whose start failed before `serve`). While `serve` runs (on
        another thread) this only asks it to stop, and `serve` releases them as it returns. Safe to call again."""
        with self._state_lock:
            serving = self._state == "serving"
        if serving:
            self.shutdown()
        else:
            self._release()

    def _release(self) -> None:
        """Abort what is in flight, answer its clients and release everything (once; `serve`'s end or `close`)."""
        with self._state_lock:
            if self._state == "closed":
                return
            self._state = "closed"
        self.compiles.close()  # every compile ends (their processes with them) before the groups are answered
        self._desk.close(self._send)
        self.manager.stop(block=True, timeout=30)
        self._updates.close()
        self._unloads.conclude()  # unloads the stopped engine never ran are answered ("internal", it stopped)
        self._desk.flush(self._send)
        self._links.flush(encode_s=None)  # the last results are encoded whole: nothing is served after them
        self._links.close()
        self._socket.close(linger=2000)  # let the final abort results reach their clients
        if self._auth is not None:
            self._auth.stop()
        self._context.term()
        remove_ipc_file(self._ipc_file)  # (libzmq leaves it behind)
        self._waker.close()

    def shutdown(self) -> None:
        """Ask `serve` to return (safe from signal handlers and other threads)."""
        self._stop.set()
        self._waker.wake()

    def _receive_all(self) -> None:
        # A turn ends after RECEIVE_TURN messages or RECEIVE_TURN_S, whichever first: then the loop flushes replies
        # and watches clients before reading on, so a client whose messages are costly delays the others' replies
        # by about one turn.
        ends = time.monotonic() + RECEIVE_TURN_S
        for _ in range(RECEIVE_TURN):
            if time.monotonic() > ends:
                return
            # Weight buckets are large: their frames are taken without a copy.
            inbound = self._reader.read()
            if inbound is None:
                if self._reader.busy:  # a message of many frames, part read: read on while the turn lasts
                    continue
                return
            identity, frames = inbound.identity, inbound.frames
            key = frame_property(frames[0], "User-Id") if self._auth is not None and frames else None
            self._links.seen(identity, frame_fd(frames[0]) if frames else None, key)
            try:
                if inbound.refused is not None:
                    self._checks.refuse_cut(identity, frames, inbound.refused)
                else:
                    self._receive(identity, frames, key)
            except Exception as error:  # noqa: BLE001 - nothing one message does may end the serving loop
                logger.exception("a message from client %s failed", identity.hex())
                self._send(identity, p.Error("internal", f"{type(error).__name__}: {error}", None))

    def _receive(self, identity: bytes, frames: list, key: str | None) -> None:
        message = self._checks.decode(identity, frames, key)  # None: refused, and answered
        if message is None:
            return
        try:
            if isinstance(message, WEIGHT_MESSAGES):
                self._updates.handle(identity, message, frames[1:], frame_property(frames[0], "Peer-Address"), key)
            else:
                self._handle(identity, message, key)
        except Exception as error:  # noqa: BLE001 - one bad request must not stop the worker
            logger.exception("request %s failed", message.TYPE)
            group_id, update_id = getattr(message, "group_id", None), getattr(message, "update_id", None)
            reply = p.Error("internal", f"{type(error).__name__}: {error}", None, group_id, update_id)
            if not self._updates.on_malformed(identity, update_id, reply, message.TYPE):
                self._send(identity, reply)

    def _handle(self, identity: bytes, message: p.Message, key: str | None) -> None:
        if isinstance(message, p.Generate):  # with keys on, the key is the client (turns, limits, drafts)
            self._desk.generate(identity, message, self._send, key)
        elif isinstance(message, p.Cancel):
            self._desk.cancel(identity, message.group_id, self._send)
        elif isinstance(message, p.Ping):
            self._send(identity, p.Pong(message.nonce, self.policy_version))
        elif isinstance(message, p.Hello):
            self._send(identity, hello_reply(self.manager, self.model_name, self.tokenizer_name))
        elif isinstance(message, p.AdapterUnload):  # a trainer's (MessageChecks refused other keys)
            self._unloads.handle(identity, message, key)
        elif isinstance(message, p.Stats):
            self._send(identity, p.StatsReply(self.stats()))
        else:
            self._send(identity, p.Error("bad_request", f"{message.TYPE!r} is not a request", "type"))

    def _updating(self) -> list[bytes]:
        """The owner of the open update, watched for a closed connection (a vanished trainer must not hold the update
        slot until its deadline) but not for silence (the update's phase deadline bounds that)."""
        return [] if self._updates.update is None else [self._updates.update.identity]

    def _send(self, identity: bytes, message: p.Message, key: str | None = None) -> None:
        self._links.send(identity, message, key)

    def _client_lost(self, identity: bytes, reason: str) -> None:
        """A client is gone (ClientLinks tells once per loss): cancel its groups, and drop its open update when it is
        unreachable (a client lost for its silence may still be connected: its update keeps its phase deadline)."""
        self._desk.client_lost(identity)
        if self._links.unreachable(identity):
            self._updates.client_lost(identity)

    def stats(self) -> dict:
        """The worker's counters (`worker_report.worker_stats`). Safe from any thread (the /metrics scrape reads it)."""
        return worker_stats(self.manager, self._links, self.counters, self._updates, self.tokenizer_name)
