"""RolloutClient: what a trainer process uses to get completions from one or many rollout workers.

One background I/O thread (dispatcher.py) owns every ZeroMQ socket (sockets are not thread-safe); public calls, from
any thread, check their input, hand the I/O thread a command and wait on their own results with a timeout. Groups go to the
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
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import msgpack

from rollout.config import FieldError, SamplingParams
from rollout.service import protocol as p
from rollout.service.protocol import Completion, Delta
from rollout.service.sockets import check_address
from trainer_bridge.calls import AsyncSink, Call, GroupResult, PromptGroup, RolloutError, WorkerBusy
from trainer_bridge.commands import AskStats, CancelCall, CloseChannel, OpenChannel, SendRaw, Submit
from trainer_bridge.dispatcher import Dispatcher

logger = logging.getLogger(__name__)

_INT64 = 1 << 63  # ids and counts travel as msgpack integers

__all__ = ["Completion", "Delta", "GroupResult", "PromptGroup", "RolloutClient", "RolloutError", "WorkerBusy"]


class UpdateChannel:
    """One weight update's link to the workers (see `RolloutClient.open_update_channel`)."""

    def __init__(self, client: RolloutClient, update_id: str, replies: queue.SimpleQueue):
        self.client = client
        self.update_id = update_id
        self._replies = replies

    def send(self, worker: int, message: p.Message, data: list | None = None) -> None:
        """Send `message` (and raw data frames after its header) to worker `worker`."""
        self.client._io.command(SendRaw(worker, message, data))

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
        self.client._io.command(CloseChannel(self.update_id))


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
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not addresses:
            raise ValueError("addresses: give at least one worker address")
        for address in addresses:
            problem = check_address(address)
            if problem is not None:
                raise ValueError(f"addresses: {problem}")
        keys = None if curve_secret_key is None else (curve_secret_key, server_public_key)
        self._io = Dispatcher(addresses, keys, heartbeat_s, dead_after_s, connect_timeout)
        self._started = time.monotonic()
        self._closed = self._io.closed
        self._seed_source = random.SystemRandom()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

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
        pending: set[str] = set()
        try:
            for group in groups:  # a bad group raises here: those submitted before it are cancelled below
                pending.add(self._submit(group, stream=False, sink=finished).group.group_id)
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
        self._io.command(CancelCall(group_id))

    def stats(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Each live worker's counters (queue depth, running samples, KV blocks, tokens/s, version, uptime)."""
        deadline = time.monotonic() + (min(self.timeout, 10.0) if timeout is None else timeout)
        self.wait_connected(max(0.0, deadline - time.monotonic()))  # a new client: let its workers answer first
        replies: queue.SimpleQueue = queue.SimpleQueue()
        self._io.command(AskStats(replies))
        try:
            count = replies.get(timeout=max(0.0, deadline - time.monotonic()))
            return [replies.get(timeout=max(0.0, deadline - time.monotonic())) for _ in range(count)]
        except queue.Empty:
            raise RolloutError("timeout", "a worker did not answer stats in time (or the client is closed)") from None

    def close(self) -> None:
        """Stop the I/O thread and close the sockets; calls still waiting fail with RolloutError."""
        self._io.stop()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    async def agenerate(self, group: PromptGroup, timeout: float | None = None) -> GroupResult:
        """asyncio version of `generate`: events come straight from the I/O thread into the event loop (no thread
        per call, so thousands of groups can be awaited at once); cancelling the task cancels the group."""
        sink = AsyncSink(asyncio.get_running_loop())
        call = self._submit(group, stream=False, sink=sink)
        try:
            return await sink.next(self.timeout if timeout is None else timeout, call.group.group_id)
        except BaseException:  # timeout, error reply or task cancelled: make sure nothing keeps running
            self.cancel(call.group.group_id)
            raise

    async def astream(self, group: PromptGroup, timeout: float | None = None) -> AsyncIterator[Delta | GroupResult]:
        """asyncio version of `stream`."""
        sink = AsyncSink(asyncio.get_running_loop())
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
        sink = AsyncSink(asyncio.get_running_loop())
        pending: set[str] = set()
        try:
            for group in groups:
                pending.add(self._submit(group, stream=False, sink=sink).group.group_id)
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
        return [worker.address for worker in self._io.workers]

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
            # Settled: refused, alive, or answered once and now down (no connection, or silent over one: frozen). A
            # worker that is not up yet, or reconnected but has not answered yet, is waited for.
            if all(w.refused or w.alive or (w.answered and (w.silent or not w.connected)) for w in self._io.workers):
                break
            time.sleep(0.005)
        return self.live_workers()

    def live_workers(self) -> list[int]:
        """Indices of the workers that answered and are not declared dead."""
        return [index for index, worker in enumerate(self._io.workers) if worker.alive]

    def open_update_channel(self, update_id: str) -> UpdateChannel:
        """A channel for one weight update: raw sends to chosen workers, and every reply carrying `update_id`.
        `push_weights` drives it; close it when done."""
        if self._closed.is_set():
            raise RolloutError("closed", "the client is closed")
        replies: queue.SimpleQueue = queue.SimpleQueue()
        self._io.command(OpenChannel(update_id, replies))
        return UpdateChannel(self, update_id, replies)

    # ---- caller side ------------------------------------------------------------------------------------------
    def _submit(self, group: PromptGroup, stream: bool, sink: Any = None) -> Call:
        if self._closed.is_set():
            raise RolloutError("closed", "the client is closed")
        if not isinstance(group, PromptGroup):
            raise TypeError(f"expected a PromptGroup, got {type(group).__name__}")
        group = self._checked(group)
        max_new = group.sampling.get("max_new_tokens")
        cost = group.n * (max_new if isinstance(max_new, int) and max_new > 0 else 256)
        call = Call(group, cost, stream=stream)
        if sink is not None:
            call.events = sink
        self._io.command(Submit(call))
        return call

    def _checked(self, group: PromptGroup) -> PromptGroup:
        """A copy with plain Python values (numpy/torch scalars unwrapped), a seed and a group id; bad values raise
        here, in the caller's thread, naming the field."""
        try:
            prompt_ids = [operator.index(token) for token in group.prompt_ids]
        except TypeError:
            raise RolloutError("bad_request", "token ids must be integers", "prompt_ids") from None
        if not all(0 <= token < _INT64 for token in prompt_ids):
            raise RolloutError("bad_request", "token ids must be in [0, 2**63)", "prompt_ids")
        if not isinstance(group.n, int) or isinstance(group.n, bool) or not 0 < group.n < _INT64:
            raise RolloutError("bad_request", f"n must be a positive integer, got {group.n!r}", "n")
        if group.group_id is not None and not isinstance(group.group_id, str):
            raise RolloutError("bad_request", f"group_id must be a string, got {group.group_id!r}", "group_id")
        try:
            (group.group_id or "").encode("utf-8")
        except UnicodeEncodeError:
            raise RolloutError("bad_request", "group_id must be valid Unicode text", "group_id") from None
        if isinstance(group.sampling, SamplingParams):
            sampling = group.sampling.changed_fields()
        elif isinstance(group.sampling, dict):
            try:
                sampling = {key: _plain(value) for key, value in group.sampling.items()}
                msgpack.packb(sampling)
            except (TypeError, ValueError, OverflowError, RuntimeError) as error:
                raise RolloutError(
                    "bad_request", f"sampling values must be plain numbers/strings/lists: {error}", "sampling"
                ) from None
        else:
            raise RolloutError("bad_request", "sampling must be a SamplingParams or a dict of its fields", "sampling")
        try:  # the worker's own check, here in the caller's thread
            SamplingParams.from_fields(sampling)
        except FieldError as error:
            raise RolloutError("bad_request", str(error), error.field) from None
        sampling.setdefault("seed", self._seed_source.getrandbits(62))  # a resubmitted group reproduces its tokens
        group_id = group.group_id or f"{self._prefix}-{next(self._ids)}"
        return PromptGroup(prompt_ids, group.n, sampling, group_id)

    @property
    def min_policy_version(self) -> int:
        """The newest policy version pushed through this client (`push_weights` sets it): groups go to workers
        that serve at least this one whenever one is alive."""
        return self._io.min_policy_version

    @min_policy_version.setter
    def min_policy_version(self, version: int) -> None:
        self._io.min_policy_version = version

    def _next_event(self, call: Call, timeout: float | None) -> Delta | GroupResult:
        try:
            event = call.events.get(timeout=self.timeout if timeout is None else timeout)
        except queue.Empty:
            self.cancel(call.group.group_id)
            raise RolloutError("timeout", f"group {call.group.group_id!r}: no answer in time") from None
        if isinstance(event, RolloutError):
            raise event
        return event

    def _wait_result(self, call: Call, timeout: float | None) -> GroupResult:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            event = self._next_event(call, max(0.0, deadline - time.monotonic()))
            if isinstance(event, GroupResult):
                return event
