"""The worker's groups in flight: generate requests checked against the limits, compiled off the serving loop when
they carry a structured-output constraint (constraint_compiles.py: in turn with other clients, within the worker's
compile budget), added to the engine, and their outputs turned into deltas and results; cancellation (a group still
compiling is abandoned: its compile stops, and it ends with "abort"), and the count of groups per client.

Threads: the serving thread admits and cancels; the engine thread hands outputs in (`_on_output`) and leaves the
replies in an outbox that the serving thread drains; a compile slot only hands a finished compile back (`_compiled`).
"""

from __future__ import annotations

import queue
import secrets
import threading
from collections.abc import Callable

from rollout import protocol as p
from rollout.config import FieldError, SamplingParams
from rollout.constraints import constraint_of
from rollout.engine.manager.continuous_batching import ContinuousBatchingManager, QueueFullError
from rollout.engine.requests.group_spec import GroupSpec
from rollout.engine.requests.outputs import GenerationOutput
from rollout.mailbox import drain
from rollout.protocol.group_folding import GroupInFlight, engine_id
from rollout.sampling_params import SAMPLING_FIELDS
from rollout.service.compile.constraint_compiles import ConstraintCompiles
from rollout.service.compile.jobs import CompileAbandoned, CompileJob, CompilesClosed, CompilesUnavailable
from rollout.service.group_counters import GroupCounters
from rollout.service.observability.tracing import Tracer
from rollout.service.zmq.limits import WorkerLimits, generate_refusal

# (the connection, the reply, and for a group's reply its key: `ClientLinks.send` drops it when another key holds the
# connection's routing id now)
Send = Callable[..., None]


class GroupDesk:
    """Admits, tracks and answers one worker's groups."""

    def __init__(
        self,
        manager: ContinuousBatchingManager,
        limits: WorkerLimits,
        counters: GroupCounters,
        tracer: Tracer,
        wake: Callable[[], None],
        compiles: ConstraintCompiles,
    ):
        """
        Args:
            manager: the worker's engine manager.
            limits: the worker's limits (groups per client, prompt length, n).
            counters: the worker's group counters.
            tracer: the worker's tracer (a span per group).
            wake: wakes the serving loop (outputs or compiled constraints are waiting).
            compiles: the worker's compile slots (shared with its HTTP front end; the worker closes them).
        """
        self.manager = manager
        self.limits = limits
        self.counters = counters
        self._tracer = tracer
        self._wake = wake
        self._outbox: queue.SimpleQueue[tuple[bytes, str | None, p.Message]] = queue.SimpleQueue()
        # engine id -> group; the serving thread adds, the engine thread removes
        self._groups: dict[str, GroupInFlight] = {}
        # connection -> its groups in flight, by engine id (the connections watched; a lost one's groups found
        # without a pass over every group in flight)
        self._per_client: dict[bytes, dict[str, GroupInFlight]] = {}
        self._per_key: dict[str, int] = {}  # client (`GroupInFlight.client`) -> its groups in flight (the limit)
        self._lock = threading.Lock()  # both maps change on the serving and the engine thread
        self._compiles = compiles
        self._compiling: dict[str, CompileJob] = {}  # engine id -> its compile (serving thread only)
        self._compiled: queue.SimpleQueue[tuple[CompileJob, BaseException | None]] = queue.SimpleQueue()

    # ---- serving thread ---------------------------------------------------------------------------------------
    def generate(self, identity: bytes, message: p.Generate, send: Send, key: str | None = None) -> None:
        """Admit a generate request, or refuse it by name (`send` answers on the serving thread).

        Args:
            identity: the connection it came over (its replies go there).
            message: the request.
            send: answers on the serving thread.
            key: the sender's CurveZMQ public key when the worker checks keys: then the key, not the connection, is
                the client that takes turns, holds at most --max-groups-per-client groups and shares drafts.
        """
        group = GroupInFlight(identity, message.group_id, message.prompt_ids, message.n, message.stream, key)
        running = group.engine_id in self._groups
        reply_error = generate_refusal(self.limits, message, running, self._per_key.get(group.client, 0))
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
        try:  # compiled off the loop, in turn with other clients: `admit_compiled`
            job = self._compiles.submit(group.client, sampling, self._on_compiled, (group, message, sampling))
        except QueueFullError as error:
            return self._admit(group, message, None, send, error)
        if job.state != "finished":  # (a spec refused before is answered at once, through `_compiled`)
            self._compiling[group.engine_id] = job

    def _on_compiled(self, job: CompileJob, error: BaseException | None) -> None:
        """A compile ended (a slot's thread, or the caller's): hand it to the serving thread."""
        self._compiled.put((job, error))
        self._wake()

    def admit_compiled(self, send: Send) -> None:
        """Admit the groups whose constraint finished compiling (the compile's FieldError refuses one by name); a
        group abandoned while it compiled ends with "abort" without running."""
        for job, error in drain(self._compiled):
            group, message, sampling = job.item
            if self._compiling.get(group.engine_id) is job:
                del self._compiling[group.engine_id]
            if self._groups.get(group.engine_id) is not group:  # dropped meanwhile
                continue
            if isinstance(error, CompilesClosed):
                error = QueueFullError("the worker is stopping; retry")
            elif isinstance(error, CompilesUnavailable):  # the worker's fault, not the spec's: retry (elsewhere)
                error = QueueFullError(str(error))
            if group.cancel_requested or isinstance(error, CompileAbandoned):
                self._abort(group, message, send)
            else:
                try:
                    self._admit(group, message, sampling, send, error)
                finally:  # `_admit` raised it: its traceback holds this frame, not the error too
                    error = None

    def _abort(self, group: GroupInFlight, message: p.Generate, send: Send) -> None:
        """End a group that never ran: every sample "abort", no tokens (as a cancelled running group ends)."""
        self._remove(group)
        self.counters.group_received()
        for _ in range(message.n):
            self.counters.sample_finished("abort")
        self.counters.group_finished()
        version = self.manager.engine.policy_version
        completions = [p.Completion(index, [], [], "abort", None, [], version) for index in range(message.n)]
        result = p.GroupResult(message.group_id, message.prompt_ids, completions)
        result.data_frames = []
        send(group.identity, result, group.key)

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
                try:
                    raise error
                finally:  # the traceback keeps this frame, not the error: no cycle to collect
                    error = None
            fields = dict(sampling=sampling, n=message.n, streaming=message.stream, adapter=message.adapter)
            # Admission takes turns between clients; drafts stay within one client and one session (`Generate`). A
            # group with no session is a session of its own: over its routing id alone, a connection that took a gone
            # client's id over would draw on that client's drafts.
            fields.update(client=group.client, session=message.session or f"group:{secrets.token_hex(16)}")
            self.manager.add_groups([GroupSpec(group.engine_id, message.prompt_ids, **fields)])
        except Exception as refused:  # noqa: BLE001 - the group is forgotten and its client told, whatever it was
            self._remove(group)
            self.counters.group_refused()
            send(identity, _refusal(refused, message.group_id), group.key)
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
        group.cancel_requested = True  # a group still compiling is abandoned: answered by `admit_compiled`
        self._cancel(group)

    def client_lost(self, identity: bytes) -> None:
        """Cancel every group of a client that is gone (its compiles abandoned)."""
        with self._lock:
            groups = list(self._per_client.get(identity, {}).values())
        for group in groups:
            group.cancel_requested = True
            self._cancel(group)

    def _cancel(self, group: GroupInFlight) -> None:
        job = self._compiling.get(group.engine_id)
        if job is not None:
            self._compiles.cancel(job)  # its `done` comes back through `admit_compiled`
        else:
            self.manager.cancel_request(group.engine_id)

    def identities(self) -> list[bytes]:
        """The clients with groups in flight, each once (read every loop: its cost follows the clients, not the
        groups; 20,000 groups of one client cost a list of 20,000 each turn)."""
        with self._lock:
            return list(self._per_client)

    def flush(self, send: Send) -> None:
        """Send the replies the engine thread left."""
        for identity, key, message in drain(self._outbox):
            send(identity, message, key)

    def close(self, send: Send) -> None:
        """Answer the groups whose compile ended with the worker's compile slots (closed first: every compile has
        ended): a group never admitted is answered "busy" (the worker is stopping: retry elsewhere)."""
        for job, _ in drain(self._compiled):
            self._compiling.pop(job.item[0].engine_id, None)
            self._stopping(job, send)
        for job in list(self._compiling.values()):  # (a slot that outlived the close's wait)
            self._stopping(job, send)
        self._compiling.clear()

    def _stopping(self, job: CompileJob, send: Send) -> None:
        group, message, _ = job.item
        if self._groups.get(group.engine_id) is group:
            self._remove(group)
            send(group.identity, p.Error("busy", "the worker is stopping; retry", None, message.group_id), group.key)

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _on_output(self, group: GroupInFlight, output: GenerationOutput) -> None:
        delta, result = group.absorb(output, self.manager.engine.policy_version)
        if output.generated_tokens and not group.started_sampling:
            group.started_sampling = True
            self._tracer.first_token(group.span)
        if output.is_finished:
            self.counters.sample_finished(output.finish_reason)
        if delta is not None:
            self._outbox.put((group.identity, group.key, delta))
        if result is not None:
            # Forget the group before its result can reach the client, which may then reuse the id at once.
            self._remove(group)
            self.counters.group_finished()
            self._tracer.group_finished(group.span, result.completions)
            self._outbox.put((group.identity, group.key, result))
        if delta is not None or result is not None:
            self._wake()

    # ---- either thread ----------------------------------------------------------------------------------------
    def _add(self, group: GroupInFlight) -> None:
        with self._lock:
            self._groups[group.engine_id] = group
            self._per_client.setdefault(group.identity, {})[group.engine_id] = group
            self._per_key[group.client] = self._per_key.get(group.client, 0) + 1

    def _remove(self, group: GroupInFlight) -> None:
        """Forget a finished or refused group (serving or engine thread)."""
        with self._lock:
            if self._groups.get(group.engine_id) is not group:
                return
            del self._groups[group.engine_id]
            of_client = self._per_client[group.identity]
            del of_client[group.engine_id]
            if not of_client:
                del self._per_client[group.identity]
            _count_down(self._per_key, group.client)


def _refusal(error: BaseException, group_id: str) -> p.Error:
    """The error reply of a group the engine did not take: a bad field (named), a full queue, or anything else."""
    if isinstance(error, QueueFullError):
        return p.Error("busy", str(error), None, group_id)
    if isinstance(error, FieldError):
        name = f"sampling.{error.field}" if error.field in SAMPLING_FIELDS else error.field
        return p.Error("bad_request", f"{name}: {error.reason}", name, group_id)
    return p.Error("internal", f"{type(error).__name__}: {error}", None, group_id)


def _count_down(counts: dict, who: bytes | str) -> None:
    """One group fewer for `who`; forgotten at none."""
    left = counts[who] - 1
    if left:
        counts[who] = left
    else:
        del counts[who]
