"""The rollout worker: a ZeroMQ ROUTER socket in front of a `ContinuousBatchingManager`.

Threads: the serving thread alone owns the socket (receives, answers, sends); the manager's engine thread turns
outputs into messages and leaves them in an outbox that the serving thread drains. Neither waits on the other: the
engine never blocks on I/O, and a slow engine never stalls `ping` or `stats`.

Group ids are per client: the engine sees "<client identity>/<group id>", so two trainers may both send group "0".
A client that vanishes (a send to it fails, or it has groups in flight and has been silent longer than
`client_timeout_s`) has its groups cancelled, which frees their KV blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import msgpack
import zmq

from rollout.config import FieldError, SamplingParams
from rollout.engine.engine import GenerationOutput
from rollout.engine.manager import ContinuousBatchingManager, QueueFullError
from rollout.service import protocol as p

logger = logging.getLogger(__name__)

# Engine-side field names -> the protocol's.
_FIELD_NAMES = {"input_ids": "prompt_ids", "request_id": "group_id"}
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Largest request accepted on the socket (a generate is a few KB; weight buckets travel in their own messages).
MAX_MESSAGE_BYTES = 64 << 20


@dataclass
class _Group:
    """A generate request in flight, as the client sees it."""

    identity: bytes
    group_id: str
    prompt_ids: list[int]
    n: int
    stream: bool
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    completions: list[p.Completion] = field(default_factory=list)


class RolloutWorker:
    """Serves one manager on one ROUTER socket."""

    def __init__(
        self,
        manager: ContinuousBatchingManager,
        bind: str,
        model_name: str,
        client_timeout_s: float = 60.0,
    ):
        """
        Args:
            manager: the engine manager (started by `serve`).
            bind: ZeroMQ address to bind, e.g. "tcp://127.0.0.1:5555".
            model_name: what `hello` reports.
            client_timeout_s: a client with groups in flight that sends nothing (not even ping) for this long is
                considered gone and its groups are cancelled.
        """
        self.manager = manager
        self.model_name = model_name
        self.client_timeout_s = client_timeout_s
        self.policy_version = 0
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished client raises instead of dropping
        # No send high-water mark: a slow reader must never lose a result (what waits is bounded by its groups).
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(bind)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._outbox: queue.SimpleQueue[tuple[bytes, p.Message]] = queue.SimpleQueue()
        # The engine thread writes a byte here after filling the outbox, waking the serving thread's poll (no
        # busy polling, which would steal the GIL from the engine).
        self._waker = p.Waker()
        self._groups: dict[str, _Group] = {}  # engine id -> group; the serving thread adds, the engine thread removes
        self._last_seen: dict[bytes, float] = {}
        self._stop = threading.Event()

    # ---- serving loop -----------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Start the engine and serve until `shutdown()`; then abort what is in flight and tell its clients."""
        self.manager.start()
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._waker.reader, zmq.POLLIN)
        try:
            while not self._stop.is_set() and self.manager.is_running():
                ready = dict(poller.poll(100))
                if self._socket in ready:
                    self._receive_all()
                if ready:
                    self._waker.drain()
                self._flush_outbox()
                self._expire_silent_clients()
        finally:
            self.manager.stop(block=True, timeout=30)
            self._flush_outbox()
            self._socket.close(linger=2000)  # let the final abort results reach their clients
            self._context.term()
            self._waker.close()

    def shutdown(self) -> None:
        """Ask `serve` to return (safe from signal handlers and other threads)."""
        self._stop.set()
        self._waker.wake()

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, frames = frames[0], frames[1:]
            self._last_seen[identity] = time.monotonic()
            try:
                message = p.decode(frames)
            except p.ProtocolError as error:
                self._send(identity, p.Error("bad_request", str(error), error.field, _raw_group_id(frames)))
                continue
            try:
                self._handle(identity, message)
            except Exception as error:  # noqa: BLE001 - one bad request must not stop the worker
                logger.exception("request %s failed", message.TYPE)
                group_id = getattr(message, "group_id", None)
                self._send(identity, p.Error("internal", f"{type(error).__name__}: {error}", None, group_id))

    def _handle(self, identity: bytes, message: p.Message) -> None:
        if isinstance(message, p.Generate):
            self._generate(identity, message)
        elif isinstance(message, p.Cancel):
            engine_id = _engine_id(identity, message.group_id)
            if engine_id not in self._groups:
                self._send(identity, p.Error("unknown_group", "no such group in flight", "group_id", message.group_id))
            else:
                self.manager.cancel_request(engine_id)
        elif isinstance(message, p.Ping):
            self._send(identity, p.Pong(message.nonce, self.policy_version))
        elif isinstance(message, p.Hello):
            engine = self.manager.engine
            config = dataclasses.asdict(self.manager.config)
            self._send(
                identity,
                p.HelloReply(self.model_name, engine.vocab_size, engine.max_model_len, self.policy_version, config),
            )
        elif isinstance(message, p.Stats):
            self._send(identity, p.StatsReply(self.stats()))
        else:
            self._send(identity, p.Error("bad_request", f"{message.TYPE!r} is not a request", "type"))

    def _generate(self, identity: bytes, message: p.Generate) -> None:
        engine_id = _engine_id(identity, message.group_id)
        reply_error = self._refusal(identity, message, engine_id)
        if reply_error is not None:
            self._send(identity, reply_error)
            return
        group = _Group(identity, message.group_id, message.prompt_ids, message.n, message.stream)
        self._groups[engine_id] = group
        try:
            sampling = SamplingParams(**message.sampling)
            self.manager.add_request(message.prompt_ids, engine_id, None, message.stream, message.n, sampling)
        except (FieldError, QueueFullError) as error:
            del self._groups[engine_id]
            if isinstance(error, QueueFullError):
                self._send(identity, p.Error("busy", str(error), None, message.group_id))
                return
            name = _FIELD_NAMES.get(error.field, error.field)
            name = f"sampling.{name}" if name in _SAMPLING_FIELDS else name
            self._send(identity, p.Error("bad_request", f"{name}: {error.reason}", name, message.group_id))
            return
        # Outputs that came before this line wait in the manager's queue and are handed over here, in order.
        self.manager.register_result_handler(engine_id, lambda output: self._on_output(group, output))

    def _refusal(self, identity: bytes, message: p.Generate, engine_id: str) -> p.Error | None:
        if engine_id in self._groups:
            return p.Error("duplicate_group", "a group with this id is still running", "group_id", message.group_id)
        if message.sampling.get("top_logprobs"):
            reason = "top_logprobs are not carried over the socket yet"
            return p.Error("bad_request", reason, "sampling.top_logprobs", message.group_id)
        unknown = sorted(set(message.sampling) - _SAMPLING_FIELDS)
        if unknown:
            return p.Error(
                "bad_request", f"unknown sampling field {unknown[0]!r}", f"sampling.{unknown[0]}", message.group_id
            )
        return None

    # ---- engine thread -> outbox ------------------------------------------------------------------------------
    def _on_output(self, group: _Group, output: GenerationOutput) -> None:
        index = output.sample_index
        tokens = group.token_ids.setdefault(index, [])
        logprobs = group.logprobs.setdefault(index, [])
        if group.stream:
            tokens.extend(output.generated_tokens)
            logprobs.extend(output.logprobs)
            if output.generated_tokens:
                delta = p.Delta(group.group_id, index, output.generated_tokens, output.logprobs, self.policy_version)
                self._outbox.put((group.identity, delta))
                self._waker.wake()
        else:
            tokens[:], logprobs[:] = output.generated_tokens, output.logprobs
        if not output.is_finished:
            return
        versions = [[self.policy_version, 0]] if tokens else []
        group.completions.append(
            p.Completion(index, tokens, logprobs, output.finish_reason, output.error, versions, self.policy_version)
        )
        if len(group.completions) == group.n:
            # Forget the group before its result can reach the client, which may then reuse the id at once.
            engine_id = _engine_id(group.identity, group.group_id)
            if self._groups.get(engine_id) is group:
                del self._groups[engine_id]
            completions = sorted(group.completions, key=lambda c: c.sample_index)
            self._outbox.put((group.identity, p.GroupResult(group.group_id, group.prompt_ids, completions)))
            self._waker.wake()

    def _flush_outbox(self) -> None:
        while True:
            try:
                identity, message = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(identity, message)

    def _send(self, identity: bytes, message: p.Message) -> None:
        try:
            self._socket.send_multipart([identity, *p.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as error:
            if error.errno != zmq.EHOSTUNREACH:  # not expected without a send high-water mark
                logger.error("cannot send %s to client %s: %s", message.TYPE, identity.hex(), error)
                return
            logger.warning("client %s is gone; cancelling its groups", identity.hex())
            self._cancel_client(identity)

    def _cancel_client(self, identity: bytes) -> None:
        for engine_id, group in list(self._groups.items()):
            if group.identity == identity:
                self.manager.cancel_request(engine_id)

    def _expire_silent_clients(self) -> None:
        now = time.monotonic()
        busy = {group.identity for group in list(self._groups.values())}
        for identity in [i for i in self._last_seen if i not in busy]:  # only clients with work are watched
            del self._last_seen[identity]
        for identity in busy:
            if now - self._last_seen.get(identity, now) > self.client_timeout_s:
                logger.warning(
                    "client %s silent for %.0f s; cancelling its groups", identity.hex(), self.client_timeout_s
                )
                self._last_seen[identity] = now  # cancel once, not every loop
                self._cancel_client(identity)

    def stats(self) -> dict:
        """The manager's counters plus policy version, groups in flight, clients and tokens/s since start."""
        stats = self.manager.stats()
        uptime = max(stats["uptime_s"], 1e-9)
        stats.update(
            policy_version=self.policy_version,
            groups_in_flight=len(self._groups),
            clients=len(self._last_seen),
            tokens_per_s=stats["generated_tokens"] / uptime,
        )
        return stats


def _raw_group_id(frames: list[bytes]) -> str | None:
    """The group id of an undecodable request, when its header still has a string one (so the client can route
    the error to the waiting call)."""
    try:
        header = msgpack.unpackb(frames[0], raw=False)
    except Exception:  # noqa: BLE001
        return None
    value = header.get("group_id") if isinstance(header, dict) else None
    return value if isinstance(value, str) else None


def _engine_id(identity: bytes, group_id: str) -> str:
    return f"{identity.hex()}/{group_id}"
