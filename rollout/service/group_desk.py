"""The worker's groups in flight: generate requests checked against the limits, compiled off the serving loop when
they carry a structured-output constraint (constraint_compiles.py), added to the engine, and their outputs turned
into deltas and results; cancellation, and the count of groups per client.

Threads: the serving thread admits and cancels; the engine thread hands outputs in (`_on_output`) and leaves the
replies in an outbox that the serving thread drains; a compile thread only compiles.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from rollout.config import FieldError, SamplingParams
from rollout.constraints import constraint_of
from rollout.engine.manager import ContinuousBatchingManager, QueueFullError
from rollout.engine.outputs import GenerationOutput
from rollout.mailbox import drain
from rollout.sampling_params import SAMPLING_FIELDS
from rollout.service import protocol as p
from rollout.service.constraint_compiles import ConstraintCompiles
from rollout.service.group_counters import GroupCounters
from rollout.service.groups import GroupInFlight, engine_id
from rollout.service.limits import WorkerLimits, generate_refusal
from rollout.service.tracing import Tracer

Send = Callable[[bytes, p.Message], None]
MAX_PENDING_COMPILES = 64  # constraints queued or compiling; a generate past it is answered "busy"


class GroupDesk:
    """Admits, tracks and answers one worker's groups."""

    def __init__(
        self,
        manager: ContinuousBatchingManager,
        limits: WorkerLimits,
        counters: GroupCounters,
        tracer: Tracer,
        wake: Callable[[], None],
    ):
        """
        Args:
            manager: the worker's engine manager.
            limits: the worker's limits (groups per client, prompt length, n).
            counters: the worker's group counters.
            tracer: the worker's tracer (a span per group).
            wake: wakes the serving loop (outputs or compiled constraints are waiting).
        """
        self.manager = manager
        self.limits = limits
        self.counters = counters
        self._tracer = tracer
        self._wake = wake
        self._outbox: queue.SimpleQueue[tuple[bytes, p.Message]] = queue.SimpleQueue()
        # engine id -> group; the serving thread adds, the engine thread removes
        self._groups: dict[str, GroupInFlight] = {}
        self._per_client: dict[bytes, int] = {}
        self._lock = threading.Lock()  # both maps change on the serving and the engine thread
        self._compiles: ConstraintCompiles = ConstraintCompiles(manager.engine.intake.constraint, wake)

    # ---- serving thread ---------------------------------------------------------------------------------------
    def generate(self, identity: bytes, message: p.Generate, send: Send) -> None:
        """Admit a generate request, or refuse it by name (`send` answers on the serving thread)."""
        group = GroupInFlight(identity, message.group_id, message.prompt_ids, message.n, message.stream)
        running = group.engine_id in self._groups
        reply_error = generate_refusal(self.limits, message, running, self._per_client.get(identity, 0))
        if reply_error is not None:
            self.counters.group_refused()
            send(identity, reply_error)
            return
        self._add(group)
        try:
            sampling = SamplingParams.from_fields(message.sampling)
        except Exception as error:  # noqa: BLE001 - a FieldError names the field; anything else is answered too
            return self._admit(group, message, None, send, error)
        if constraint_of(sampling) is None:
            return self._admit(group, message, sampling, send)
        if self._compiles.num_pending >= MAX_PENDING_COMPILES:
            reason = f"{MAX_PENDING_COMPILES} structured-output constraints are being compiled; retry later"
            return self._admit(group, message, None, send, QueueFullError(reason))
        self._compiles.submit((group, message, sampling), sampling)  # compiled off the loop: `admit_compiled`

    def admit_compiled(self, send: Send) -> None:
        """Admit the groups whose constraint finished compiling (the compile's FieldError refuses one by name)."""
        for (group, message, sampling), error in self._compiles.ready():
            if self._groups.get(group.engine_id) is group:  # not dropped with its client meanwhile
                self._admit(group, message, sampling, send, error)

    def _admit(
        self,
        group: GroupInFlight,
        message: p.Generate,
        sampling: SamplingParams | None,
        send: Send,
        error: BaseException | None = None,
    ) -> None:
        """Add a checked group to the engine, or refuse it naming the field at fault (`error`: found already)."""
        identity = group.identity
        try:
            if error is not None:
                raise error
            fields = dict(sampling=sampling, n=message.n, streaming=message.stream, adapter=message.adapter)
            self.manager.add_group(group.engine_id, message.prompt_ids, **fields)
        except Exception as refused:  # noqa: BLE001 - the group is forgotten and its client told, whatever it was
            self._remove(group)
            self.counters.group_refused()
            send(identity, _refusal(refused, message.group_id))
            return
        self.counters.group_received()
        group.span = self._tracer.group_started(message.group_id, identity.hex(), message.n, len(message.prompt_ids))
        # Outputs that came before this line wait in the manager's queue and are handed over here, in order.
        self.manager.register_result_handler(group.engine_id, lambda output: self._on_output(group, output))
        if group.cancel_requested:  # cancelled while its constraint compiled
            self.manager.cancel_request(group.engine_id)

    def cancel(self, identity: bytes, group_id: str, send: Send) -> None:
        """Cancel a client's group (its samples end with "abort"), or answer "unknown_group"."""
        group = self._groups.get(engine_id(identity, group_id))
        if group is None:
            send(identity, p.Error("unknown_group", "no such group in flight", "group_id", group_id))
            return
        group.cancel_requested = True  # a group still compiling is cancelled once admitted
        self.manager.cancel_request(group.engine_id)

    def client_lost(self, identity: bytes) -> None:
        """Cancel every group of a client that is gone."""
        for group in list(self._groups.values()):
            if group.identity == identity:
                group.cancel_requested = True
                self.manager.cancel_request(group.engine_id)

    def identities(self) -> list[bytes]:
        """The clients with groups in flight (one entry per group)."""
        return [group.identity for group in list(self._groups.values())]

    def flush(self, send: Send) -> None:
        """Send the replies the engine thread left."""
        for identity, message in drain(self._outbox):
            send(identity, message)

    def close(self, send: Send) -> None:
        """Stop compiling; a group never admitted is answered "busy" (the worker is stopping: retry elsewhere)."""
        for group, message, _ in self._compiles.close():
            self._remove(group)
            send(group.identity, p.Error("busy", "the worker is stopping; retry", None, message.group_id))

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _on_output(self, group: GroupInFlight, output: GenerationOutput) -> None:
        delta, result = group.absorb(output, self.manager.engine.policy_version)
        if output.generated_tokens and not group.started_sampling:
            group.started_sampling = True
            self._tracer.first_token(group.span)
        if output.is_finished:
            self.counters.sample_finished(output.finish_reason)
        if delta is not None:
            self._outbox.put((group.identity, delta))
        if result is not None:
            # Forget the group before its result can reach the client, which may then reuse the id at once.
            self._remove(group)
            self.counters.group_finished()
            self._tracer.group_finished(group.span, result.completions)
            self._outbox.put((group.identity, result))
        if delta is not None or result is not None:
            self._wake()

    # ---- either thread ----------------------------------------------------------------------------------------
    def _add(self, group: GroupInFlight) -> None:
        with self._lock:
            self._groups[group.engine_id] = group
            self._per_client[group.identity] = self._per_client.get(group.identity, 0) + 1

    def _remove(self, group: GroupInFlight) -> None:
        """Forget a finished or refused group (serving or engine thread)."""
        with self._lock:
            if self._groups.get(group.engine_id) is not group:
                return
            del self._groups[group.engine_id]
            left = self._per_client[group.identity] - 1
            if left:
                self._per_client[group.identity] = left
            else:
                del self._per_client[group.identity]


def _refusal(error: BaseException, group_id: str) -> p.Error:
    """The error reply of a group the engine did not take: a bad field (named), a full queue, or anything else."""
    if isinstance(error, QueueFullError):
        return p.Error("busy", str(error), None, group_id)
    if isinstance(error, FieldError):
        name = f"sampling.{error.field}" if error.field in SAMPLING_FIELDS else error.field
        return p.Error("bad_request", f"{name}: {error.reason}", name, group_id)
    return p.Error("internal", f"{type(error).__name__}: {error}", None, group_id)
