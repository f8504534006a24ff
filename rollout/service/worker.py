"""The rollout worker: a ZeroMQ ROUTER socket in front of a `ContinuousBatchingManager`.

Threads: the serving thread alone owns the socket (receives, answers, sends); the manager's engine thread turns
outputs into messages and leaves them in an outbox that the serving thread drains. Neither waits on the other: the
engine never blocks on I/O, and a slow engine never stalls `ping` or `stats`.

Group ids are per client: the engine sees "<client identity>/<group id>", so two trainers may both send group "0".
A client that vanishes (a send to it fails, or it has groups in flight and has been silent longer than
`client_timeout_s`) has its groups cancelled, which frees their KV blocks.

Weight updates (see `weights.py`): one at a time. The serving thread stages buckets as they come and rejects the
update at the first bad byte, phase deadline or client disappearance; on commit the engine thread applies it
between two steps and the answer goes back through the outbox. torch.distributed buckets are received by their own
thread (`dist.DistReceiver`), so pings are answered during a long broadcast.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import msgpack
import torch
import zmq

from rollout.config import FieldError, SamplingParams
from rollout.engine.engine import WeightUpdateResult
from rollout.engine.manager import ContinuousBatchingManager, QueueFullError
from rollout.engine.outputs import GenerationOutput
from rollout.service import protocol as p
from rollout.service.dist import DistReceiver
from rollout.service.weights import StagedUpdate, StagingPool, UpdateRejected

logger = logging.getLogger(__name__)

# Engine-side field names -> the protocol's.
_FIELD_NAMES = {"input_ids": "prompt_ids", "request_id": "group_id"}
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


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
    versions: dict[int, list[list[int]]] = field(default_factory=dict)
    completions: list[p.Completion] = field(default_factory=list)


class RolloutWorker:
    """Serves one manager on one ROUTER socket."""

    def __init__(
        self,
        manager: ContinuousBatchingManager,
        bind: str,
        model_name: str,
        client_timeout_s: float = 60.0,
        keep_staging: bool = True,
    ):
        """
        Args:
            manager: the engine manager (started by `serve`).
            bind: ZeroMQ address to bind, e.g. "tcp://127.0.0.1:5555".
            model_name: what `hello` reports.
            client_timeout_s: a client with groups in flight that sends nothing (not even ping) for this long is
                considered gone and its groups are cancelled.
            keep_staging: keep a weight update's host staging area (and shared segment) for the next update instead
                of freeing it: faster updates for one update-sized host buffer held between them.
        """
        self.manager = manager
        self.model_name = model_name
        self.client_timeout_s = client_timeout_s
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished client raises instead of dropping
        # No send high-water mark: a slow reader must never lose a result (what waits is bounded by its groups).
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)  # per frame
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
        self._update: StagedUpdate | None = None  # serving thread only
        # Finished steps of an update, from other threads: (update, reply) for the serving thread to conclude.
        self._update_events: queue.SimpleQueue[tuple[StagedUpdate, p.Message]] = queue.SimpleQueue()
        self._dist: DistReceiver | None = None
        self._device = next(manager.engine.model.parameters()).device
        self._staging = StagingPool(keep=keep_staging, pin=self._device.type == "cuda")

    @property
    def policy_version(self) -> int:
        """The version of the weights being served."""
        return self.manager.engine.policy_version

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
                self._conclude_update_steps()
                self._flush_outbox()
                self._expire_silent_clients()
                self._expire_update()
        finally:
            self.manager.stop(block=True, timeout=30)
            self._conclude_update_steps()
            if self._update is not None:
                self._reject_update(p.Error("internal", "the worker is shutting down", None))
            if self._dist is not None:
                self._dist.close()
            self._staging.close()
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
                # Weight buckets are large: take their frames without a copy (small ones come as plain bytes).
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, frames = frames[0].bytes, frames[1:]
            self._last_seen[identity] = time.monotonic()
            try:
                message = p.decode(frames)
                if len(frames) > 1 and not isinstance(message, p.WeightsBucket):
                    raise p.ProtocolError("frames", f"a {message.TYPE} message carries no data frames")
            except p.ProtocolError as error:
                group_id, update_id = _raw_ids(frames)
                reply = p.Error("bad_request", str(error), error.field, group_id, update_id)
                update = self._update
                if update is not None and update.update_id == update_id and update.identity == identity:
                    if not update.committing:
                        self._reject_update(reply)  # a malformed message of an open update drops it
                        continue
                self._send(identity, reply)
                continue
            try:
                if isinstance(message, _WEIGHT_MESSAGES):
                    self._handle_weights(identity, message, frames[1:])
                else:
                    self._handle(identity, message)
            except Exception as error:  # noqa: BLE001 - one bad request must not stop the worker
                logger.exception("request %s failed", message.TYPE)
                group_id, update_id = getattr(message, "group_id", None), getattr(message, "update_id", None)
                reply = p.Error("internal", f"{type(error).__name__}: {error}", None, group_id, update_id)
                if self._update is not None and self._update.update_id == update_id:
                    self._reject_update(reply)
                else:
                    self._send(identity, reply)

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

    # ---- weight updates ---------------------------------------------------------------------------------------
    def _handle_weights(self, identity: bytes, message: p.Message, data_frames: list) -> None:
        update_id = message.update_id
        if isinstance(message, p.WeightsSpec):
            specs = [p.TensorSpec(n, d, list(s)) for n, (d, s) in self.manager.engine.weight_specs().items()]
            self._send(identity, p.WeightsSpecReply(update_id, specs, self.policy_version))
            return
        update = self._update
        if isinstance(message, p.WeightsBegin):
            if update is not None:
                reason = f"update {update.update_id!r} is still open; one update at a time"
                self._send(identity, p.Error("update_in_progress", reason, "update_id", None, update_id))
                return
            self._begin_update(identity, message)
            return
        if update is None or update.update_id != update_id or update.identity != identity:
            self._send(identity, p.Error("unknown_update", "no such open update", "update_id", None, update_id))
            return
        update.touch()
        if isinstance(message, p.WeightsAbort):
            if update.committing:
                reason = "the update is being committed; it cannot be aborted now"
                self._send(identity, p.Error("update_committing", reason, "update_id", None, update_id))
                return
            received = update.received_bytes
            self._end_uncleanly()
            self._send(identity, p.WeightsAck(update_id, received, "aborted"))
            return
        if update.committing:
            reason = "the update is being committed"
            self._send(identity, p.Error("update_committing", reason, "update_id", None, update_id))
            return
        try:
            if isinstance(message, p.WeightsBucket):
                self._receive_bucket(update, message, data_frames)
            elif isinstance(message, p.WeightsCommit):
                self._commit_update(update)
        except UpdateRejected as error:
            self._reject_update(p.Error(error.code, str(error), error.field, None, update_id))

    def _begin_update(self, identity: bytes, message: p.WeightsBegin) -> None:
        try:
            update = StagedUpdate(message, self.manager.engine, identity, self._staging)
        except UpdateRejected as error:
            self._send(identity, p.Error(error.code, str(error), error.field, None, message.update_id))
            return
        self._update = update
        logger.info(
            "weight update %s: %d tensors, %.1f MB over %s, mode %s",
            update.update_id,
            len(update.specs),
            update.staging_bytes / 1e6,
            message.transport,
            message.mode,
        )
        ready = p.WeightsReady(update.update_id, update.staging_bytes, update.shm.name if update.shm else None)
        if message.transport != "torch.distributed":
            self._send(identity, ready)
            return
        if self._dist is None:
            self._dist = DistReceiver()

        def joined(error: BaseException | None) -> None:  # on the receiver thread
            reply = ready if error is None else p.Error("bad_update", f"cannot join the group: {error}", "dist")
            self._update_events.put((update, reply))
            self._waker.wake()

        self._dist.join(message.dist, message.timeout_s, joined)

    def _receive_bucket(self, update: StagedUpdate, message: p.WeightsBucket, data_frames: list) -> None:
        transport = update.begin.transport
        if transport == "frames":
            update.accept_frames(message.pieces, data_frames)
        elif transport == "shm":
            update.accept_written(message.pieces)
        else:
            update.announce(message.pieces)
            device = self._device if update.begin.dist["backend"] == "nccl" else torch.device("cpu")

            def received(error: BaseException | None) -> None:  # on the receiver thread
                if update.closed:
                    return  # rejected meanwhile: drop the bytes
                if error is not None:
                    reply: p.Message = p.Error("bad_update", f"broadcast failed: {error}", "dist")
                else:
                    update.mark_received(message.pieces)
                    reply = p.WeightsAck(update.update_id, update.received_bytes)
                self._update_events.put((update, reply))
                self._waker.wake()

            # One broadcast per piece, straight into its place in the staging area.
            self._dist.receive(update.staging_views(message.pieces), device, received, lambda: update.closed)
            return
        self._send(update.identity, p.WeightsAck(update.update_id, update.received_bytes))

    def _commit_update(self, update: StagedUpdate) -> None:
        tensors = update.tensors()  # raises UpdateRejected naming an incomplete tensor
        update.committing = True
        begin = update.begin

        def applied(outcome: WeightUpdateResult | BaseException) -> None:  # on the engine thread
            if isinstance(outcome, WeightUpdateResult):
                reply: p.Message = p.WeightsCommitted(
                    update.update_id,
                    outcome.version,
                    outcome.pause_ms,
                    outcome.copy_ms,
                    outcome.drain_ms,
                    outcome.aborted,
                    outcome.recomputed,
                )
            elif isinstance(outcome, FieldError):
                reply = p.Error("bad_update", str(outcome), outcome.field, None, update.update_id)
            elif isinstance(outcome, TimeoutError):
                reply = p.Error("update_timeout", str(outcome), "mode", None, update.update_id)
            else:
                reply = p.Error("internal", f"{type(outcome).__name__}: {outcome}", None, None, update.update_id)
            self._update_events.put((update, reply))
            self._waker.wake()

        self.manager.submit_weight_update(tensors, begin.version, begin.mode, begin.partial, begin.timeout_s, applied)

    def _conclude_update_steps(self) -> None:
        """Serving thread: send what the engine or receiver thread finished; close the update when it ended."""
        while True:
            try:
                update, reply = self._update_events.get_nowait()
            except queue.Empty:
                return
            if update is not self._update:
                continue  # rejected or aborted meanwhile
            if isinstance(reply, p.Error):
                self._reject_update(reply)
                continue
            update.touch()
            if isinstance(reply, p.WeightsCommitted):
                self._close_update()
                logger.info(
                    "weight update %s committed: version %d, pause %.1f ms (copy %.1f ms)",
                    update.update_id,
                    reply.version,
                    reply.pause_ms,
                    reply.copy_ms,
                )
            self._send(update.identity, reply)

    def _reject_update(self, error: p.Error) -> None:
        """End the open update unapplied and tell its client why."""
        update = self._update
        if update is None:
            return
        logger.warning("weight update %s rejected: %s", update.update_id, error.message)
        self._end_uncleanly()
        error.update_id = update.update_id
        self._send(update.identity, error)

    def _close_update(self, clean: bool = True) -> None:
        if self._update is not None:
            self._update.close(clean)
            self._update = None

    def _end_uncleanly(self) -> None:
        """Close an update that was rejected or aborted: its staging is not reused (a client that has not heard
        yet may still write into a shared segment, a broadcast into a dist one), and a dist group is dropped (the
        trainer may be stuck mid-broadcast)."""
        dist = self._update is not None and self._update.begin.transport == "torch.distributed"
        self._close_update(clean=False)
        if dist and self._dist is not None:
            self._dist.forget()

    def _expire_update(self) -> None:
        update = self._update
        if update is not None and update.expired(time.monotonic()):
            reason = f"no message of the update within its phase deadline of {update.begin.timeout_s:g} s"
            self._reject_update(p.Error("update_timeout", reason, None))

    # ---- engine thread -> outbox ------------------------------------------------------------------------------
    def _on_output(self, group: _Group, output: GenerationOutput) -> None:
        index = output.sample_index
        tokens = group.token_ids.setdefault(index, [])
        logprobs = group.logprobs.setdefault(index, [])
        if group.stream:
            tokens.extend(output.generated_tokens)
            logprobs.extend(output.logprobs)
            if output.generated_tokens:
                version = output.policy_versions[-1][0] if output.policy_versions else self.policy_version
                delta = p.Delta(group.group_id, index, output.generated_tokens, output.logprobs, version)
                self._outbox.put((group.identity, delta))
                self._waker.wake()
        else:
            tokens[:], logprobs[:] = output.generated_tokens, output.logprobs
        if group.stream:
            _extend_runs(
                group.versions.setdefault(index, []), output.policy_versions, len(tokens) - len(output.generated_tokens)
            )
        else:
            group.versions[index] = output.policy_versions
        if not output.is_finished:
            return
        kv_version_min = output.kv_version_min if output.kv_version_min is not None else self.policy_version
        group.completions.append(
            p.Completion(
                index,
                tokens,
                logprobs,
                output.finish_reason,
                output.error,
                group.versions.get(index, []),
                kv_version_min,
            )
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
            frames = p.encode(message)
        except Exception as error:  # noqa: BLE001 - a reply that cannot be encoded must not end the serving loop
            logger.exception("cannot encode a %s reply", message.TYPE)
            ids = getattr(message, "group_id", None), getattr(message, "update_id", None)
            frames = p.encode(
                p.Error("internal", f"the {message.TYPE} reply could not be encoded: {error}", None, *ids)
            )
        try:
            self._socket.send_multipart([identity, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as error:
            if error.errno != zmq.EHOSTUNREACH:  # not expected without a send high-water mark
                logger.error("cannot send %s to client %s: %s", message.TYPE, identity.hex(), error)
                return
            logger.warning("client %s is gone; cancelling its groups", identity.hex())
            self._cancel_client(identity)
            if self._update is not None and self._update.identity == identity and not self._update.committing:
                self._reject_update(p.Error("update_timeout", "the client is gone", None))

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


_WEIGHT_MESSAGES = (p.WeightsSpec, p.WeightsBegin, p.WeightsBucket, p.WeightsCommit, p.WeightsAbort)


def _extend_runs(runs: list[list[int]], new_runs: list[list[int]], first_index: int) -> None:
    """Append a delta's run-length encoded versions (indices relative to the delta) to a sample's runs."""
    for version, first in new_runs:
        if not runs or runs[-1][0] != version:
            runs.append([version, first_index + first])


def _raw_ids(frames: list) -> tuple[str | None, str | None]:
    """The group and update ids of an undecodable request, when its header still has string ones (so the client
    can route the error to the waiting call)."""
    try:
        header = msgpack.unpackb(frames[0].bytes if hasattr(frames[0], "bytes") else frames[0], raw=False)
    except Exception:  # noqa: BLE001
        return None, None
    if not isinstance(header, dict):
        return None, None
    group_id, update_id = header.get("group_id"), header.get("update_id")
    return (group_id if isinstance(group_id, str) else None), (update_id if isinstance(update_id, str) else None)


def _engine_id(identity: bytes, group_id: str) -> str:
    return f"{identity.hex()}/{group_id}"
