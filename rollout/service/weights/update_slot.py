"""The worker's weight-update slot: one `StagedUpdate` (staged_update.py) open at a time, driven by the serving thread.

Buckets are staged as they come and the update is rejected at the first bad byte, missed phase deadline or
disappearance of its client; on commit the engine thread applies it between two steps and the answer comes back
through `conclude()`. torch.distributed buckets are received by their own thread (`dist.DistReceiver`), so pings are
answered during a long broadcast.

The slot cannot be held hostage: a phase deadline is at most `max_phase_s`; only the update's own messages renew
it; a new `weights_begin` from the same client replaces its open update, and one with `preempt` from another
(trainer) client takes the slot over (the old update is rejected with "update_preempted"). torch.distributed makes
the worker connect out only to the host the `weights_begin` came from (or this machine, when it came over loopback).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

from rollout import protocol as p
from rollout.engine.manager.commands import AdapterUpdate
from rollout.engine.manager.continuous_batching import ContinuousBatchingManager
from rollout.engine.weights.weight_table import WeightUpdateResult
from rollout.mailbox import drain
from rollout.protocol.staging import StagingPool
from rollout.protocol.transports import transport_named
from rollout.protocol.transports.base import Receiver
from rollout.service.observability.tracing import Tracer
from rollout.service.weights.commit_reply import commit_reply
from rollout.service.weights.preparing import StagingPreparer
from rollout.service.weights.served_base import ServedBase
from rollout.service.weights.spec_answers import SpecAnswers
from rollout.service.weights.staged_update import StagedUpdate, UpdateRejected
from rollout.service.weights.update_counts import UpdateCounts
from rollout.service.weights.update_turn import UpdateTurn, begin_conflict

logger = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 5.0  # for the last update's jobs (its staging goes back) when the worker stops
MAX_QUEUED_BUCKETS = 4  # per update; a trainer keeps two in flight per worker (push.py)
WEIGHT_MESSAGES = (p.WeightsSpec, p.WeightsBegin, p.WeightsBucket, p.WeightsCommit, p.WeightsAbort)
WEIGHT_TYPES = frozenset(message.TYPE for message in WEIGHT_MESSAGES)


class UpdateSlot:
    """The one open weight update of a worker. Serving thread only, except the callbacks noted."""

    def __init__(
        self,
        manager: ContinuousBatchingManager,
        send: Callable[..., None],
        wake: Callable[[], None],
        max_phase_s: float,
        keep_staging: bool = True,
        check_finite: bool = False,
        tracer: Tracer | None = None,
    ):
        """
        Args:
            manager: the engine manager the updates go into.
            send: how a reply reaches a client (identity, message, and the key an update's later replies are for).
            wake: wakes the serving thread after another thread finished a step.
            max_phase_s: the longest phase deadline (`timeout_s`) an update may ask for.
            keep_staging: keep the host staging area for the next update.
            check_finite: refuse an update holding NaN or Inf in a floating tensor (checked at commit).
            tracer: where the update's span goes (tracing.py).
        """
        self.manager = manager
        self._send = send
        self._wake = wake
        self.max_phase_s = max_phase_s
        self.check_finite = check_finite
        self.update: StagedUpdate | None = None
        self._last: StagedUpdate | None = None  # the newest update, whose staging may still be on its way back
        # Finished steps, from the engine or receiver thread: (update, reply) for the serving thread to conclude.
        self._events: queue.SimpleQueue[tuple[StagedUpdate, p.Message]] = queue.SimpleQueue()
        self._receivers: dict[str, Receiver] = {}  # each transport's receiver, made at its first update
        self._device = next(manager.engine.model.parameters()).device
        self._staging = StagingPool(keep=keep_staging, pin_device=self._device if self._device.type == "cuda" else None)
        self._spec_answers = SpecAnswers(manager.engine)  # weights_spec's (any client may ask, often)
        self._preparer = StagingPreparer()  # staging areas: on job threads, one at a time
        self.counts = UpdateCounts()  # refused, committed bytes and pauses (stats())
        # The names of the base weights served: adapter updates for another base are refused.
        self.base = ServedBase()
        self._tracer = tracer or Tracer()
        self._span: Any = None
        self.turn = UpdateTurn()  # one update at a time, with those committed outside ZeroMQ

    @property
    def policy_version(self) -> int:
        return self.manager.engine.policy_version

    def handle(
        self, identity: bytes, message: p.Message, data_frames: list, peer: str | None, key: str | None = None
    ) -> None:
        """Serve one weight-update message.

        Args:
            identity: the sender.
            message: one of WEIGHT_MESSAGES.
            data_frames: raw frames after the header (a frames bucket's bytes).
            peer: the sender's IP address, when ZeroMQ knows it (TCP).
            key: the sender's CurveZMQ key (None: keys off); a begun update's later replies go only to it.
        """
        update_id = message.update_id
        if isinstance(message, p.WeightsSpec):
            self._send(identity, self._spec_answers.reply(update_id, self.base))
            return
        update = self.update
        if isinstance(message, p.WeightsBegin):
            if update is not None and not self._may_vacate(identity, message):
                return
            with self.turn.inside() as outside:
                if outside is None:
                    self._begin(identity, message, peer, key)
            if outside is not None:  # not preemptible: it is read and committed as one call
                self._send(identity, p.Error("update_in_progress", outside, "update_id", None, message.update_id))
            return
        if update is None or update.update_id != update_id or update.identity != identity:
            self._send(identity, p.Error("unknown_update", "no such open update", "update_id", None, update_id))
            return
        update.touch()
        if update.committing:
            aborting = isinstance(message, p.WeightsAbort)
            reason = "the update is being committed" + ("; it cannot be aborted now" if aborting else "")
            self._send(identity, p.Error("update_committing", reason, "update_id", None, update_id))
            return
        if isinstance(message, p.WeightsAbort):
            received = update.received_bytes
            self._tracer.update_ended(self._span, "aborted")
            self._span = None
            self._end_uncleanly()
            self._send(identity, p.WeightsAck(update_id, received, "aborted"))
            return
        try:
            if isinstance(message, p.WeightsBucket):
                self._receive_bucket(update, message, data_frames)
            elif isinstance(message, p.WeightsCommit):
                self._commit(update)
        except UpdateRejected as error:
            self.reject(p.Error(error.code, str(error), error.field, None, update_id))

    def _may_vacate(self, identity: bytes, message: p.WeightsBegin) -> bool:
        """Whether a new begin may take the place of the open update (else it is answered "update_in_progress"). The
        same client's begin drops it at once (it abandoned it); another's with `preempt` only once its own fields
        passed their checks (`_begin`): a refused begin changes nothing."""
        update = self.update
        assert update is not None
        takes_over, reason = begin_conflict(update, identity, message.preempt)
        if not takes_over:
            self._send(identity, p.Error("update_in_progress", reason, "update_id", None, message.update_id))
        elif update.identity == identity:
            self.reject(p.Error("update_preempted", reason, None))
        return takes_over

    def _begin(self, identity: bytes, message: p.WeightsBegin, peer: str | None, key: str | None) -> None:
        try:
            update = StagedUpdate(
                message,
                self.manager.engine,
                identity,
                self._staging,
                self._receiver,
                peer,
                self.max_phase_s,
                self.base.base_id,
                key,
                self.base.names(),
            )
        except UpdateRejected as error:
            self.counts.refused()
            logger.warning("weight update %s refused at its begin: %s", message.update_id, error)
            self._send(identity, p.Error(error.code, str(error), error.field, None, message.update_id))
            return
        if self.update is not None:  # another client's, taken over by a preempting begin that passed its checks
            self.reject(p.Error("update_preempted", "another trainer took the update slot over (preempt)", None))
        self.update = self._last = update
        self._span = self._tracer.update_started(
            update.update_id, len(update.specs), update.staging_bytes, message.transport, message.mode
        )
        logger.info(
            "weight update %s: %d tensors, %.1f MB over %s, mode %s",
            update.update_id,
            len(update.specs),
            update.staging_bytes / 1e6,
            message.transport,
            message.mode,
        )
        update.jobs.submit(lambda: self._preparer.prepare(update, self._report))  # its staging area, then weights_ready

    def _receiver(self, transport: str) -> Receiver:
        """This worker's receiver of `transport` (a known name), made at its first update and kept."""
        if transport not in self._receivers:
            self._receivers[transport] = transport_named(transport).receiver(self._device)
        return self._receivers[transport]

    def _receive_bucket(self, update: StagedUpdate, message: p.WeightsBucket, data_frames: list) -> None:
        """Check the bucket's structure here; its bytes are hashed, staged or received on the update's job thread,
        which acks it (so the serving thread's work per bucket does not grow with its size). Buckets waiting for
        their acks are counted, not the update's jobs: its staging area's, still being made, is none."""
        if update.unacked >= MAX_QUEUED_BUCKETS:
            raise UpdateRejected(
                "bad_update", "pieces", f"more than {MAX_QUEUED_BUCKETS} buckets wait for their acks (wait for them)"
            )
        pieces, receiver = message.pieces, update.receiver
        receiver.accept_bucket(update, pieces, data_frames)
        update.unacked += 1

        def take_bytes() -> None:
            receiver.take_bytes(update, update.begin, pieces, data_frames, message.checksum)

        def job() -> None:
            if update.ended or not update.prepared:
                return  # rejected meanwhile, or it has no staging area: the bytes are not wanted
            try:
                take_bytes()
            except UpdateRejected as rejected:
                self._report(update, p.Error(rejected.code, str(rejected), rejected.field))
            except Exception as error:  # noqa: BLE001 - answered now: unanswered, the client waited out its deadline
                reason = f"staging a bucket failed, nothing changed: {type(error).__name__}: {error}"
                self._report(update, p.Error("internal", reason, None))
            else:
                self._report(update, p.WeightsAck(update.update_id, update.received_bytes))

        update.jobs.submit(job)

    def _commit(self, update: StagedUpdate) -> None:
        """Hand the staged tensors to the engine once every bucket before the commit was taken (and, with
        `check_finite`, checked for NaN and Inf): both on the update's job thread."""
        update.committing = True
        begin = update.begin

        def applied(outcome: WeightUpdateResult | BaseException) -> None:  # on the engine thread
            update.base_unchanged = isinstance(outcome, WeightUpdateResult) and outcome.base_unchanged
            self._report(update, commit_reply(update.update_id, outcome))

        def job() -> None:
            if update.ended or not update.prepared:
                return  # rejected meanwhile, or it has no staging area (the error that says why is on its way)
            try:
                tensors = update.tensors(self.check_finite)  # names an incomplete or NaN tensor
                adapter = None if begin.adapter is None else AdapterUpdate(begin.adapter, begin.scalings)
                self.manager.weight_updates.submit(
                    tensors, begin.version, begin.mode, begin.partial, begin.timeout_s, applied, adapter
                )
            except UpdateRejected as rejected:
                self._report(update, p.Error(rejected.code, str(rejected), rejected.field))
            except Exception as error:  # noqa: BLE001 - a committing update never expires: unanswered, it held the slot
                reason = f"the commit's checks failed, nothing changed: {type(error).__name__}: {error}"
                self._report(update, p.Error("internal", reason, None))

        update.jobs.submit(job)

    def _report(self, update: StagedUpdate, reply: p.Message) -> None:
        """From another thread: `reply` concludes a step of `update`; the serving thread sends it (`conclude`)."""
        self._events.put((update, reply))
        self._wake()

    def conclude(self) -> None:
        """Send what the engine or receiver thread finished; close the update when it ended."""
        for update, reply in drain(self._events):
            if update is not self.update:
                continue  # rejected or aborted meanwhile
            if isinstance(reply, p.Error):
                self.reject(reply)
                continue
            update.touch()
            if isinstance(reply, p.WeightsAck):
                update.unacked -= 1
            if isinstance(reply, p.WeightsCommitted):
                self.update = None
                update.end(clean=True)
                update.receiver.ended(update.begin, clean=True)
                self.base.committed(update.begin, update.brings_base, update.base_unchanged)
                self.counts.committed(update.staging_bytes, reply.pause_ms)
                self._tracer.update_ended(self._span, "committed", reply.version, reply.pause_ms)
                self._span = None
                logger.info(
                    "weight update %s committed: version %d, pause %.1f ms (copy %.1f ms)",
                    update.update_id,
                    reply.version,
                    reply.pause_ms,
                    reply.copy_ms,
                )
            self._send(update.identity, reply, update.key)

    def on_malformed(self, identity: bytes, update_id: str | None, reply: p.Error, kind: str | None) -> bool:
        """A malformed weight message naming the open update drops it (True: handled, the client was told); a
        message of another type that names it (a `ping` with an `update_id`) costs the update nothing.

        Args:
            identity: the sender.
            update_id: the id the message named, if any.
            reply: the refusal, sent to the update's client when the update is dropped.
            kind: the message's type, when its header had one.
        """
        update = self.update
        if kind not in WEIGHT_TYPES or update is None or update.update_id != update_id:
            return False
        if update.identity != identity or update.committing:
            return False
        self.reject(reply)
        return True

    def reject(self, error: p.Error) -> None:
        """End the open update unapplied and tell its client why."""
        update = self.update
        if update is None:
            return
        self.counts.refused()
        self._tracer.update_ended(self._span, error.code)
        self._span = None
        logger.warning("weight update %s rejected: %s", update.update_id, error.message)
        self._end_uncleanly()
        error.update_id = update.update_id
        self._send(update.identity, error, update.key)

    def client_lost(self, identity: bytes) -> None:
        """Drop the open update of a client that is gone (unless the engine is already applying it)."""
        if self.update is not None and self.update.identity == identity and not self.update.committing:
            self.reject(p.Error("update_timeout", "the client is gone", None))

    def expire(self, now: float) -> None:
        """Reject the open update when its client missed a phase deadline."""
        update = self.update
        if update is not None and update.expired(now):
            reason = f"no message of the update within its phase deadline of {update.begin.timeout_s:g} s"
            self.reject(p.Error("update_timeout", reason, None))

    def _end_uncleanly(self) -> None:
        """Close an update that was rejected or aborted: its staging is not reused (a client that has not heard
        yet may still write into a shared segment, a broadcast into a dist one), and a dist group is dropped (the
        trainer may be stuck mid-broadcast)."""
        update, self.update = self.update, None
        if update is None:
            return
        update.end(clean=False)
        update.receiver.ended(update.begin, clean=False)

    def close(self) -> None:
        """At shutdown: conclude finished steps, reject what is open, stop the receiver, free staging."""
        self.conclude()
        last = self.update or self._last
        if self.update is not None:
            self.reject(p.Error("internal", "the worker is shutting down", None))
        if last is not None and not last.jobs.join(SHUTDOWN_WAIT_S):
            logger.warning("weight update %s: its jobs did not end within %g s", last.update_id, SHUTDOWN_WAIT_S)
        for receiver in self._receivers.values():
            receiver.close()
        self._staging.close()
