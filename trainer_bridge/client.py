"""RolloutClient: what a trainer process uses to get completions from one or many rollout workers.

One background I/O thread owns every ZeroMQ socket (sockets are not thread-safe); public calls, from any thread,
check their input, hand the I/O thread a command and wait on their own results with a timeout. Groups go to the
live worker with the least outstanding work (tokens still to generate), a whole group to one worker so its prompt
is shared. Every worker is pinged every `heartbeat_s`; one whose ping stays unanswered for `dead_after_s` is
declared dead and its unfinished groups are resubmitted to the others (with none alive, calls wait for one until
their timeout). A dead worker that answers again is used again, and the groups taken from it are cancelled there.

Every group carries a seed (the client draws one if the caller did not), so a resubmitted group reproduces the same
tokens and a stream skips what it already delivered: no group is lost and none is returned twice. That splice is
exact when both workers compute the same numbers (same model, hardware and dtype); otherwise the tokens after the
failover point may come from a different sample.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import operator
import os
import queue
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from rollout.service import protocol as p
from rollout.service.auth import secure_client_socket
from rollout.service.protocol import Completion, Delta
from rollout.service.sockets import Waker, check_address

logger = logging.getLogger(__name__)

# Socket monitor events that mean a worker refused this client (a key it does not accept, or no key where it wants
# one): reported at once instead of waiting out the connect deadline.
_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
# Once the first worker answered, calls submitted before wait this long for the others to answer too.
FIRST_CONTACT_GRACE_S = 0.5

__all__ = ["Completion", "Delta", "GroupResult", "PromptGroup", "RolloutClient", "RolloutError", "WorkerBusy"]


@dataclass
class PromptGroup:
    """A prompt to sample `n` completions of (a GRPO group)."""

    prompt_ids: list[int]
    n: int = 1
    # rollout.SamplingParams field names: temperature, top_p, max_new_tokens, seed, stop_token_ids, ...
    sampling: dict[str, Any] = field(default_factory=dict)
    group_id: str | None = None


@dataclass
class GroupResult:
    """All completions of a group, in sample order."""

    group_id: str
    prompt_ids: list[int]
    completions: list[Completion]


class RolloutError(RuntimeError):
    """A worker refused or failed a request, or no answer came in time.

    Attributes:
        code: the worker's error code ("bad_request", "busy", "timeout", "no_workers", ...).
        field: the offending field, when one was named.
    """

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(f"{code}: {message}" + (f" (field {field})" if field else ""))
        self.code = code
        self.field = field


class WorkerBusy(RolloutError):
    """The worker's queue is full; retry later or add workers."""


@dataclass
class _Call:
    group: PromptGroup
    cost: int
    # Where Delta, GroupResult or RolloutError events go: a queue.SimpleQueue, or an _AsyncSink for coroutines.
    events: Any = field(default_factory=queue.SimpleQueue)
    worker: int | None = None
    stream: bool = False
    # Per sample index: tokens handed to the caller, and tokens received from the current worker. After a failover
    # the new worker resends from token 0 (same seed, same tokens); only positions >= delivered are passed on.
    delivered: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    # The id the current worker knows the group by: the group id at first, "<group id>~retry<k>" after a failover,
    # so a resubmission never collides with the first run (still running on a worker that was only slow).
    wire_id: str = ""
    attempts: int = 0


class UpdateChannel:
    """One weight update's link to the workers (see `RolloutClient.open_update_channel`)."""

    def __init__(self, client: RolloutClient, update_id: str, replies: queue.SimpleQueue):
        self.client = client
        self.update_id = update_id
        self._replies = replies

    def send(self, worker: int, message: p.Message, data: list | None = None) -> None:
        """Send `message` (and raw data frames after its header) to worker `worker`."""
        self.client._command("send_raw", (worker, message, data))

    def receive(self, timeout: float) -> tuple[int, p.Message]:
        """The next reply of any worker to this update, as (worker index, message).

        Raises:
            RolloutError: code "timeout" when none came in time.
        """
        try:
            return self._replies.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise RolloutError("timeout", f"weight update {self.update_id}: no answer within {timeout:.1f} s") from None

    def close(self) -> None:
        """Stop routing replies to this channel."""
        self.client._command("close_channel", self.update_id)


class _AsyncSink:
    """Where the I/O thread puts a call's events when the caller is a coroutine: straight into an asyncio.Queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, event: Any) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def next(self, timeout: float, group_id: str) -> Delta | GroupResult:
        try:
            event = await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise RolloutError("timeout", f"group {group_id!r}: no answer in time") from None
        if isinstance(event, RolloutError):
            raise event
        return event


class _Worker:
    def __init__(self, context: zmq.Context, address: str, keys: tuple[Any, Any] | None):
        self.address = address
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # No send high-water mark: messages for a worker not up yet wait in this client instead of being refused
        # (a refused send would lose the group); the client's own calls bound what waits.
        self.socket.setsockopt(zmq.SNDHWM, 0)
        # No receive high-water mark either: ZeroMQ's I/O thread always reads, so the worker's heartbeats are
        # answered even while this process is slow to take replies (a worker drops a peer that stops answering).
        self.socket.setsockopt(zmq.RCVHWM, 0)
        if keys is not None:
            secure_client_socket(self.socket, *keys)
        self.monitor = self.socket.get_monitor_socket(_HANDSHAKE_FAILURES)
        self.socket.connect(address)
        # Groups only go to a worker that answered: one that is not up yet (or a wrong address) gets pings only,
        # so nothing queued for it can reach it twice (once queued, once resubmitted) when it comes up.
        self.alive = False
        self.answered = False  # ever
        self.refused: str | None = None  # why the worker refused this client's connection (its key), if it did
        self.warned = False  # "never answered" was logged
        self.last_ping = 0.0
        self.unanswered_since: float | None = None  # first ping sent since the worker was last heard from
        self.outstanding = 0  # tokens still to generate for groups in flight
        self.policy_version = 0  # as of the worker's last pong or weight commit
        self.taken_away: set[str] = set()  # groups resubmitted elsewhere while this worker was dead


def _plain(value: Any) -> Any:
    """A sampling value as plain Python: numpy / torch scalars and arrays become numbers and lists, recursively."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


class RolloutClient:
    """Client of one or several rollout workers. Safe to use from several threads; use `close()` (or `with`)."""

    def __init__(
        self,
        addresses: str | list[str],
        timeout: float = 300.0,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 10.0,
        connect_timeout: float = 20.0,
        curve_secret_key: str | os.PathLike | bytes | None = None,
        server_public_key: str | os.PathLike | bytes | None = None,
    ):
        """
        Args:
            addresses: one worker address ("tcp://host:port") or a list of them.
            timeout: default seconds any call waits for its answer.
            heartbeat_s: seconds between pings to each worker.
            dead_after_s: a worker silent this long is dead; its groups go to the others.
            connect_timeout: seconds to wait for the first answer of any worker; when none answered by then, calls
                fail with code "no_workers" naming the addresses (raise it for workers that take long to start).
            curve_secret_key: this client's CurveZMQ key pair (a `.key_secret` file from `rollout-keygen`, or a z85
                secret key), for workers started with `--curve-secret-key`.
            server_public_key: the workers' public key (their `.key` file, or z85); with `curve_secret_key`.
        """
        if (curve_secret_key is None) != (server_public_key is None):
            raise ValueError("curve_secret_key and server_public_key: give both (an authenticated worker) or neither")
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout: must be positive, got {connect_timeout!r}")
        self.timeout = timeout
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.connect_timeout = connect_timeout
        self._started = time.monotonic()
        self._first_answer_at: float | None = None  # when the first worker answered
        self._context = zmq.Context()
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not addresses:
            raise ValueError("addresses: give at least one worker address")
        for address in addresses:
            problem = check_address(address)
            if problem is not None:
                raise ValueError(f"addresses: {problem}")
        keys = None if curve_secret_key is None else (curve_secret_key, server_public_key)
        try:
            self._workers = [_Worker(self._context, address, keys) for address in addresses]
        except (ValueError, zmq.ZMQError) as error:
            self._context.destroy(linger=0)
            raise ValueError(f"curve_secret_key/server_public_key: {error}") from None
        self._calls: dict[str, _Call] = {}  # I/O thread only: group id -> call
        self._by_wire: dict[str, _Call] = {}  # I/O thread only: wire id -> call
        self._parked: list[_Call] = []  # I/O thread only: calls waiting for any worker to be alive
        self._stats_sinks: list[deque[queue.SimpleQueue]] = [deque() for _ in self._workers]  # I/O thread only
        self._channels: dict[str, queue.SimpleQueue] = {}  # I/O thread only: weight update id -> its replies
        # The newest policy version pushed through this client (push_weights sets it): groups go to workers that
        # serve at least this one whenever one is alive.
        self.min_policy_version = 0
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._waker = Waker()
        self._closed = threading.Event()
        self._seed_source = random.SystemRandom()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._thread = threading.Thread(target=self._loop, name="rollout-client", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------------------------
    def generate(self, group: PromptGroup, timeout: float | None = None) -> GroupResult:
        """Sample a group and return all its completions.

        Args:
            group: the prompt, n and sampling settings.
            timeout: seconds to wait (default: the client's).
        Raises:
            RolloutError: refused (names the field), busy (`WorkerBusy`), or no answer within the timeout.
        A wait that ends without the result (timeout, Ctrl-C, any exception) cancels the group on its worker.
        """
        call = self._submit(group, stream=False)
        try:
            return self._wait_result(call, timeout)
        except BaseException:
            self.cancel(call.group.group_id)  # do not leave the group computing for nobody
            raise

    def stream(self, group: PromptGroup, timeout: float | None = None) -> Iterator[Delta | GroupResult]:
        """Yield `Delta`s (new tokens of one sample) as they come, then the `GroupResult`.

        Args:
            group: the prompt, n and sampling settings.
            timeout: most seconds to wait for each next event.
        """
        call = self._submit(group, stream=True)
        finished = False
        try:
            while not finished:
                event = self._next_event(call, timeout)
                finished = isinstance(event, GroupResult)
                yield event
        finally:
            if not finished:  # the caller stopped early (or failed): do not leave the group running
                self.cancel(call.group.group_id)

    def generate_many(self, groups: Iterable[PromptGroup], timeout: float | None = None) -> Iterator[GroupResult]:
        """Submit every group at once and yield each result as it finishes (not in submission order).

        Args:
            groups: the groups.
            timeout: most seconds to wait for the next result.
        """
        finished: queue.SimpleQueue = queue.SimpleQueue()
        calls = [self._submit(group, stream=False, sink=finished) for group in groups]
        pending = {call.group.group_id for call in calls}
        try:
            while pending:
                try:
                    event = finished.get(timeout=self.timeout if timeout is None else timeout)
                except queue.Empty:
                    raise RolloutError("timeout", "no group finished in time") from None
                if isinstance(event, RolloutError):
                    raise event
                pending.discard(event.group_id)
                yield event
        finally:
            for group_id in pending:  # an error, a timeout or an abandoned iterator: cancel what is left
                self.cancel(group_id)

    def cancel(self, group_id: str) -> None:
        """Abort a group in flight; its waiter gets the partial completions with finish_reason "abort"."""
        self._command("cancel", group_id)

    def stats(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Each live worker's counters (queue depth, running samples, KV blocks, tokens/s, version, uptime)."""
        deadline = time.monotonic() + (min(self.timeout, 10.0) if timeout is None else timeout)
        self.wait_connected(max(0.0, deadline - time.monotonic()))  # a new client: let its workers answer first
        replies: queue.SimpleQueue = queue.SimpleQueue()
        self._command("stats", replies)
        try:
            count = replies.get(timeout=max(0.0, deadline - time.monotonic()))
            return [replies.get(timeout=max(0.0, deadline - time.monotonic())) for _ in range(count)]
        except queue.Empty:
            raise RolloutError("timeout", "a worker did not answer stats in time (or the client is closed)") from None

    def close(self) -> None:
        """Stop the I/O thread and close the sockets; calls still waiting fail with RolloutError."""
        if not self._closed.is_set():
            self._closed.set()
            self._waker.wake()
            self._thread.join(10)

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    async def agenerate(self, group: PromptGroup, timeout: float | None = None) -> GroupResult:
        """asyncio version of `generate`: events come straight from the I/O thread into the event loop (no thread
        per call, so thousands of groups can be awaited at once); cancelling the task cancels the group."""
        sink = _AsyncSink(asyncio.get_running_loop())
        call = self._submit(group, stream=False, sink=sink)
        try:
            return await sink.next(self.timeout if timeout is None else timeout, call.group.group_id)
        except BaseException:  # timeout, error reply or task cancelled: make sure nothing keeps running
            self.cancel(call.group.group_id)
            raise

    async def astream(self, group: PromptGroup, timeout: float | None = None) -> AsyncIterator[Delta | GroupResult]:
        """asyncio version of `stream`."""
        sink = _AsyncSink(asyncio.get_running_loop())
        call = self._submit(group, stream=True, sink=sink)
        finished = False
        try:
            while not finished:
                event = await sink.next(self.timeout if timeout is None else timeout, call.group.group_id)
                finished = isinstance(event, GroupResult)
                yield event
        finally:
            if not finished:
                self.cancel(call.group.group_id)

    async def agenerate_many(
        self, groups: Iterable[PromptGroup], timeout: float | None = None
    ) -> AsyncIterator[GroupResult]:
        """asyncio version of `generate_many`: each result as it finishes."""
        sink = _AsyncSink(asyncio.get_running_loop())
        pending = {self._submit(group, stream=False, sink=sink).group.group_id for group in groups}
        try:
            while pending:
                result = await sink.next(self.timeout if timeout is None else timeout, "any")
                pending.discard(result.group_id)
                yield result
        finally:
            for group_id in pending:
                self.cancel(group_id)

    # ---- weight updates (used by trainer_bridge.weight_sync) ---------------------------------------------------
    @property
    def worker_addresses(self) -> list[str]:
        """Every worker's address, in the order given."""
        return [worker.address for worker in self._workers]

    def wait_connected(self, timeout: float | None = None) -> list[int]:
        """Wait until every worker answered once (or refused this client), at most until `connect_timeout` after
        this client was made or `timeout` seconds; return `live_workers()`. Calls need not wait: groups wait for
        a worker by themselves. `push_weights` waits, to reach every worker that is up.

        Args:
            timeout: most seconds to wait (default: what is left of connect_timeout).
        """
        deadline = min(
            self._started + self.connect_timeout,
            time.monotonic() + (self.connect_timeout if timeout is None else timeout),
        )
        while time.monotonic() < deadline and not self._closed.is_set():
            if all(worker.answered or worker.refused for worker in self._workers):
                break
            time.sleep(0.005)
        return self.live_workers()

    def live_workers(self) -> list[int]:
        """Indices of the workers that answered and are not declared dead."""
        return [index for index, worker in enumerate(self._workers) if worker.alive]

    def open_update_channel(self, update_id: str) -> UpdateChannel:
        """A channel for one weight update: raw sends to chosen workers, and every reply carrying `update_id`.
        `push_weights` drives it; close it when done."""
        if self._closed.is_set():
            raise RolloutError("closed", "the client is closed")
        replies: queue.SimpleQueue = queue.SimpleQueue()
        self._command("open_channel", (update_id, replies))
        return UpdateChannel(self, update_id, replies)

    # ---- caller side ------------------------------------------------------------------------------------------
    def _submit(self, group: PromptGroup, stream: bool, sink: Any = None) -> _Call:
        if self._closed.is_set():
            raise RolloutError("closed", "the client is closed")
        if not isinstance(group, PromptGroup):
            raise TypeError(f"expected a PromptGroup, got {type(group).__name__}")
        group = self._checked(group)
        max_new = group.sampling.get("max_new_tokens")
        cost = group.n * (max_new if isinstance(max_new, int) and max_new > 0 else 256)
        call = _Call(group, cost, stream=stream)
        if sink is not None:
            call.events = sink
        self._command("submit", call)
        return call

    def _checked(self, group: PromptGroup) -> PromptGroup:
        """A copy with plain Python values (numpy/torch scalars unwrapped), a seed and a group id; bad values raise
        here, in the caller's thread, naming the field."""
        try:
            prompt_ids = [operator.index(token) for token in group.prompt_ids]
        except TypeError:
            raise RolloutError("bad_request", "token ids must be integers", "prompt_ids") from None
        if not isinstance(group.n, int) or isinstance(group.n, bool):
            raise RolloutError("bad_request", f"n must be an integer, got {group.n!r}", "n")
        if group.group_id is not None and not isinstance(group.group_id, str):
            raise RolloutError("bad_request", f"group_id must be a string, got {group.group_id!r}", "group_id")
        if not isinstance(group.sampling, dict):
            raise RolloutError("bad_request", "sampling must be a dict of SamplingParams fields", "sampling")
        try:
            sampling = {key: _plain(value) for key, value in group.sampling.items()}
            msgpack.packb(sampling)
        except (TypeError, ValueError, OverflowError, RuntimeError) as error:
            raise RolloutError(
                "bad_request", f"sampling values must be plain numbers/strings/lists: {error}", "sampling"
            ) from None
        sampling.setdefault("seed", self._seed_source.getrandbits(62))  # a resubmitted group reproduces its tokens
        group_id = group.group_id or f"{self._prefix}-{next(self._ids)}"
        return PromptGroup(prompt_ids, group.n, sampling, group_id)

    def _command(self, name: str, payload: Any) -> None:
        self._commands.put((name, payload))
        self._waker.wake()

    def _next_event(self, call: _Call, timeout: float | None) -> Delta | GroupResult:
        try:
            event = call.events.get(timeout=self.timeout if timeout is None else timeout)
        except queue.Empty:
            self.cancel(call.group.group_id)
            raise RolloutError("timeout", f"group {call.group.group_id!r}: no answer in time") from None
        if isinstance(event, RolloutError):
            raise event
        return event

    def _wait_result(self, call: _Call, timeout: float | None) -> GroupResult:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            event = self._next_event(call, max(0.0, deadline - time.monotonic()))
            if isinstance(event, GroupResult):
                return event

    # ---- I/O thread -------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._waker.reader, zmq.POLLIN)
        for worker in self._workers:
            poller.register(worker.socket, zmq.POLLIN)
            poller.register(worker.monitor, zmq.POLLIN)
        sockets = {worker.socket: index for index, worker in enumerate(self._workers)}
        monitors = {worker.monitor: index for index, worker in enumerate(self._workers)}
        try:
            while not self._closed.is_set():
                wait_ms = 50 if self._parked else int(self.heartbeat_s * 1000 / 2)  # parked calls: look again soon
                for sock, _ in poller.poll(wait_ms):
                    if sock is self._waker.reader or sock == self._waker.reader.fileno():
                        self._waker.drain()
                    elif sock in monitors:
                        self._on_refusal(monitors[sock])
                    else:
                        self._receive(sockets[sock])
                self._run_commands()
                self._heartbeat()
        except BaseException:
            logger.exception("rollout client I/O thread failed")
            raise
        finally:
            self._closed.set()  # later calls fail at once instead of waiting for a dead thread
            for call in self._calls.values():
                call.events.put(RolloutError("closed", "the client was closed"))
            for worker in self._workers:
                worker.socket.disable_monitor()
                worker.monitor.close(linger=0)
                worker.socket.close(linger=0)
            self._context.term()
            self._waker.close()

    def _run_commands(self) -> None:
        while True:
            try:
                name, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if name == "submit":
                if self._unreachable() is not None:
                    payload.events.put(RolloutError("no_workers", self._unreachable()))
                    continue
                if payload.group.group_id in self._calls:
                    message = "a group with this id is still in flight on this client"
                    payload.events.put(RolloutError("duplicate_group", message, "group_id"))
                    continue
                self._calls[payload.group.group_id] = payload
                self._dispatch(payload)
            elif name == "cancel":
                call = self._calls.get(payload)
                if call is None:
                    continue
                if call.worker is not None:
                    self._send(call.worker, p.Cancel(call.wire_id))
                else:  # parked: nobody has it, so it ends here
                    self._calls.pop(payload)
                    self._by_wire.pop(call.wire_id, None)
                    self._parked = [c for c in self._parked if c is not call]
            elif name == "open_channel":
                self._channels[payload[0]] = payload[1]
            elif name == "close_channel":
                self._channels.pop(payload, None)
            elif name == "send_raw":
                index, message, data = payload
                self._send(index, message, data)
            elif name == "stats":
                live = [index for index, worker in enumerate(self._workers) if worker.alive]
                payload.put(len(live))
                for index in live:
                    self._stats_sinks[index].append(payload)
                    self._send(index, p.Stats())

    def _dispatch(self, call: _Call) -> None:
        live = [index for index, worker in enumerate(self._workers) if worker.alive]
        # Prefer workers that serve the newest pushed weights: one that was dead during a push and came back
        # serves older ones (its tokens say so) and only gets groups while no up-to-date worker is alive.
        current = [index for index in live if self._workers[index].policy_version >= self.min_policy_version]
        live = current or live
        if not live:  # wait for a worker to come (back); the caller's timeout bounds the wait
            self._parked.append(call)
            return
        index = min(live, key=lambda i: self._workers[i].outstanding)
        call.worker = index
        self._workers[index].outstanding += call.cost
        group = call.group
        self._by_wire.pop(call.wire_id, None)
        call.attempts += 1
        call.wire_id = group.group_id if call.attempts == 1 else f"{group.group_id}~retry{call.attempts - 1}"
        self._by_wire[call.wire_id] = call
        self._send(index, p.Generate(call.wire_id, group.prompt_ids, group.n, group.sampling, call.stream))

    def _send(self, index: int, message: p.Message, data: list | None = None) -> None:
        try:
            if data:  # tensor bytes: handed to ZeroMQ without a copy (it keeps a reference until sent)
                self._workers[index].socket.send_multipart(p.encode(message) + data, zmq.NOBLOCK, copy=False)
            else:
                self._workers[index].socket.send_multipart(p.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the heartbeat will declare the worker dead and resubmit its groups

    def _receive(self, index: int) -> None:
        worker = self._workers[index]
        while True:
            try:
                frames = worker.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            worker.unanswered_since = None
            if not worker.alive:
                self._revive(index)
            try:
                message = p.decode(frames)
            except p.ProtocolError:
                logger.warning("undecodable message from %s", worker.address)
                continue
            self._handle(index, message)

    def _handle(self, index: int, message: p.Message) -> None:
        if isinstance(message, (p.Pong, p.WeightsCommitted)):
            version = message.policy_version if isinstance(message, p.Pong) else message.version
            self._workers[index].policy_version = version
        channel = self._channels.get(getattr(message, "update_id", None))
        if channel is not None:
            channel.put((index, message))
            return
        if isinstance(message, p.StatsReply):
            if self._stats_sinks[index]:
                self._stats_sinks[index].popleft().put({"address": self._workers[index].address, **message.stats})
            return
        call = self._by_wire.get(getattr(message, "group_id", None))
        if call is None or call.worker != index:
            return  # a pong, or a late answer from a worker the group was taken away from
        group_id = call.group.group_id
        if isinstance(message, p.Delta):
            sample = message.sample_index
            first = call.received.get(sample, 0)  # position of this delta's first token
            call.received[sample] = first + len(message.token_ids)
            skip = max(0, call.delivered.get(sample, 0) - first)
            if skip < len(message.token_ids):
                call.delivered[sample] = call.received[sample]
                call.events.put(
                    Delta(
                        group_id,
                        sample,
                        message.token_ids[skip:],
                        message.logprobs[skip:],
                        message.policy_version,
                    )
                )
        elif isinstance(message, p.GroupResult):
            self._finish(call)
            call.events.put(GroupResult(group_id, message.prompt_ids, message.completions))
        elif isinstance(message, p.Error):
            self._finish(call)
            kind = WorkerBusy if message.code == "busy" else RolloutError
            call.events.put(kind(message.code, message.message, message.field))

    def _finish(self, call: _Call) -> None:
        self._calls.pop(call.group.group_id, None)
        self._by_wire.pop(call.wire_id, None)
        if call.worker is not None:
            self._workers[call.worker].outstanding -= call.cost

    def _unreachable(self) -> str | None:
        """Why no call can be served: every worker refused this client or none answered within connect_timeout
        (None while one answered, or the deadline has not passed)."""
        if any(worker.answered for worker in self._workers):
            return None
        waited = time.monotonic() - self._started
        if waited <= self.connect_timeout and not all(worker.refused for worker in self._workers):
            return None
        reasons = [
            f"{worker.address}: {worker.refused or f'no answer within {self.connect_timeout:g} s'}"
            for worker in self._workers
        ]
        return (
            "no rollout worker answered (" + "; ".join(reasons) + "). Is rollout-worker running at that address "
            "and port? If it is still starting, give RolloutClient a larger connect_timeout."
        )

    def _fail_parked(self) -> None:
        reason = self._unreachable()
        if reason is None or not self._parked:
            return
        parked, self._parked = self._parked, []
        for call in parked:
            if self._calls.get(call.group.group_id) is call:
                self._finish(call)
                call.events.put(RolloutError("no_workers", reason))

    def _on_refusal(self, index: int) -> None:
        """A socket monitor event: the worker refused this client's handshake (its key, or a missing one)."""
        worker = self._workers[index]
        while True:
            try:
                event = recv_monitor_message(worker.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                reason = "refused this client's key (not among its --authorized-keys/--trainer-keys)"
            else:
                reason = "the security handshake failed (do both sides use CurveZMQ keys, and the right server key?)"
            if worker.refused != reason:
                logger.error("rollout worker %s %s", worker.address, reason)
            worker.refused = reason
        self._fail_parked()

    def _heartbeat(self) -> None:
        """Ping every worker (dead ones too, so they can come back); one whose ping stays unanswered for
        dead_after_s is declared dead and its groups move to the others. Fail parked calls once no worker can
        be reached."""
        now = time.monotonic()
        self._fail_parked()
        self._release_parked()
        for index, worker in enumerate(self._workers):
            if not worker.answered and not worker.warned and now - self._started > self.connect_timeout:
                worker.warned = True
                logger.warning(
                    "rollout worker %s never answered within %.0f s (not running, or a wrong address or port?)",
                    worker.address,
                    self.connect_timeout,
                )
            if (
                worker.alive
                and worker.unanswered_since is not None
                and now - worker.unanswered_since > self.dead_after_s
            ):
                logger.warning("rollout worker %s stopped answering; resubmitting its groups", worker.address)
                worker.alive = False
                self._failover(index)
            if now - worker.last_ping >= self.heartbeat_s:
                worker.last_ping = now
                if worker.unanswered_since is None:
                    worker.unanswered_since = now
                self._send(index, p.Ping())

    def _failover(self, index: int) -> None:
        """Resubmit every group of a dead worker to the live ones (streams skip what they already delivered)."""
        worker = self._workers[index]
        for call in [c for c in self._calls.values() if c.worker == index]:
            worker.outstanding -= call.cost
            worker.taken_away.add(call.wire_id)
            call.worker = None
            call.received = {}
            self._dispatch(call)

    def _revive(self, index: int) -> None:
        """A worker answered for the first time, or again after it was declared dead: cancel what it no longer
        owns, and give it the parked calls."""
        worker = self._workers[index]
        if worker.answered:
            logger.warning("rollout worker %s is answering again", worker.address)
        else:
            logger.info("connected to rollout worker %s", worker.address)
        worker.alive = worker.answered = True
        worker.refused = None
        for group_id in worker.taken_away:
            self._send(index, p.Cancel(group_id))
        worker.taken_away.clear()
        if self._first_answer_at is None:
            self._first_answer_at = time.monotonic()
        self._release_parked()

    def _release_parked(self) -> None:
        """Dispatch the calls waiting for a worker. At first contact, wait up to FIRST_CONTACT_GRACE_S for the
        other workers to answer too, so that groups submitted before any answered are spread over all of them."""
        if not self._parked or self._first_answer_at is None:
            return
        starting = [w for w in self._workers if not w.answered and not w.refused]
        if starting and time.monotonic() - self._first_answer_at < FIRST_CONTACT_GRACE_S:
            return
        parked, self._parked = self._parked, []
        for call in parked:
            if self._calls.get(call.group.group_id) is call:
                self._dispatch(call)
