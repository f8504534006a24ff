"""The calling side of a RolloutClient's generation calls, in the caller's thread or event loop: a group checked,
seeded and named, submitted to the I/O thread, its events waited for with a timeout, and the group cancelled on its
worker whenever the caller stops waiting before its result (a timeout, an error reply, Ctrl-C, an abandoned
iterator, a cancelled task), so that no worker computes for nobody."""

from __future__ import annotations

import asyncio
import itertools
import queue
import random
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from functools import partial
from typing import Any

from rollout.protocol import Delta
from rollout.validation import is_seconds
from trainer_bridge.client.calls import (
    AsyncSink,
    Call,
    GroupResult,
    PromptGroup,
    RolloutError,
    checked_group,
    timed_out,
)
from trainer_bridge.client.commands import CancelCall, Submit


class Caller:
    """What the client's `generate`, `stream` and `generate_many` calls share, sync and asyncio.

    The client holds this object, so this one holds the client by a weak proxy: a strong reference back would be a
    cycle that keeps a dropped client (its sockets, its I/O thread) alive until the garbage collector runs. Through
    it, it reads the client's `timeout` and `adapter` when a call starts (the user may change them), and submits
    every group through the client's `_submit`, the one door that AsyncRollouts and the TRL modes use too (so a
    wrapper set on a client instance, as the long-tail benchmark sets, sees every group).
    """

    def __init__(self, client: Any, command: Callable[[Any], None], closed: threading.Event):
        """
        Args:
            client: the RolloutClient this is the calling side of.
            command: hands a command to the client's I/O thread.
            closed: set once the client is closed.
        """
        self._client = weakref.proxy(client)
        self._command = command
        self._closed = closed
        self._seed_source = random.SystemRandom()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]  # group ids unique across clients

    def submit(self, group: PromptGroup, stream: bool, sink: Any = None) -> Call:
        """Hand the I/O thread a checked copy of `group`, with a seed and an id when it has none.

        Args:
            group: the caller's group (left as given).
            stream: whether the call's events include the `Delta`s.
            sink: where its events go (a queue.SimpleQueue or an AsyncSink, maybe shared); None: a queue of its own.
        Raises:
            RolloutError: the client is closed, or a bad value (naming the field).
            TypeError: `group` is not a PromptGroup.
        """
        if self._closed.is_set():
            raise RolloutError("closed", "the client is closed")
        if not isinstance(group, PromptGroup):
            raise TypeError(f"expected a PromptGroup, got {type(group).__name__}")
        group = checked_group(group, self._new_seed, self._new_group_id, self._client.adapter)
        max_new = group.sampling.get("max_new_tokens")
        call = Call(group, group.n * (max_new if isinstance(max_new, int) and max_new > 0 else 256), stream=stream)
        if sink is not None:
            call.events = sink
        self._command(Submit(call))
        return call

    def _new_seed(self) -> int:
        return self._seed_source.getrandbits(62)

    def _new_group_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def cancel(self, group_id: str) -> None:
        """Abort a group in flight (its waiter gets the partial completions with finish_reason "abort").

        Args:
            group_id: the group's id.
        """
        self._command(CancelCall(group_id))

    def _abandon(self, call: Call) -> None:
        """Cancel `call`'s group because its caller stopped waiting: only while the group in flight under its id is
        this call's. A call refused (a duplicate id, no worker) holds nothing: cancelling by id alone would abort
        the group of the call that does hold the id."""
        self._command(CancelCall(call.group.group_id, call))

    # ---- from a thread ------------------------------------------------------------------------------------------
    def result(self, group: PromptGroup, timeout: float | None) -> GroupResult:
        """`RolloutClient.generate`: `timeout` bounds the whole wait."""
        call = self._client._submit(group, stream=False)
        try:
            deadline = time.monotonic() + self._seconds(timeout)
            while True:
                event = self._next(call, max(0.0, deadline - time.monotonic()))
                if isinstance(event, GroupResult):
                    return event
        except BaseException:
            self._abandon(call)
            raise

    def events(self, group: PromptGroup, timeout: float | None) -> Iterator[Delta | GroupResult]:
        """`RolloutClient.stream`: `timeout` bounds each wait."""
        call = self._client._submit(group, stream=True)
        finished = False
        try:
            while not finished:
                event = self._next(call, self._seconds(timeout))
                finished = isinstance(event, GroupResult)
                yield event
        finally:
            if not finished:  # the caller stopped early (or failed)
                self._abandon(call)

    def results(self, groups: Iterable[PromptGroup], timeout: float | None) -> Iterator[GroupResult]:
        """`RolloutClient.generate_many`: `timeout` bounds each wait."""
        finished: queue.SimpleQueue = queue.SimpleQueue()
        pending: dict[str, list[Call]] = {}  # group id -> this call's own submissions of it, oldest first
        try:
            for group in groups:  # a bad group raises here: those submitted before it are cancelled below
                _own(pending, self._client._submit(group, stream=False, sink=finished))
            while pending:
                try:
                    event = finished.get(timeout=self._seconds(timeout))
                except queue.Empty:
                    waited = [call for calls in pending.values() for call in calls]
                    raise timed_out("no group finished in time", self._client.outage(waited)) from None
                if isinstance(event, RolloutError):
                    try:
                        raise event
                    finally:  # the traceback keeps this frame: not the error too (a cycle only a collection frees,
                        event = None  # holding the closed client with its callers' frames)
                _done(pending, event.group_id)
                yield event
        finally:
            for call in [call for calls in pending.values() for call in calls]:  # an error, a timeout, or an
                self._abandon(call)  # abandoned iterator

    def _next(self, call: Call, timeout: float) -> Delta | GroupResult:
        try:
            event = call.events.get(timeout=timeout)
        except queue.Empty:
            raise timed_out(f"group {call.group.group_id!r}: no answer in time", self._client.outage((call,))) from None
        if isinstance(event, RolloutError):
            try:
                raise event
            finally:  # the traceback keeps this frame: not the error too (a cycle only a collection frees,
                event = None  # holding the closed client with its callers' frames)
        return event

    # ---- from asyncio: events come straight from the I/O thread into the event loop (no thread per call) ----------
    async def aresult(self, group: PromptGroup, timeout: float | None) -> GroupResult:
        """`RolloutClient.agenerate`."""
        sink = AsyncSink(asyncio.get_running_loop())
        call = self._client._submit(group, stream=False, sink=sink)
        try:
            return await sink.next(self._seconds(timeout), call.group.group_id, partial(self._client.outage, (call,)))
        except BaseException:  # a timeout, an error reply or the task cancelled
            self._abandon(call)
            raise

    async def aevents(self, group: PromptGroup, timeout: float | None) -> AsyncIterator[Delta | GroupResult]:
        """`RolloutClient.astream`."""
        sink = AsyncSink(asyncio.get_running_loop())
        call = self._client._submit(group, stream=True, sink=sink)
        finished = False
        try:
            while not finished:
                outage = partial(self._client.outage, (call,))  # (names the worker the group waits on)
                event = await sink.next(self._seconds(timeout), call.group.group_id, outage)
                finished = isinstance(event, GroupResult)
                yield event
        finally:
            if not finished:
                self._abandon(call)

    async def aresults(self, groups: Iterable[PromptGroup], timeout: float | None) -> AsyncIterator[GroupResult]:
        """`RolloutClient.agenerate_many`."""
        sink = AsyncSink(asyncio.get_running_loop())
        pending: dict[str, list[Call]] = {}
        try:
            for group in groups:
                _own(pending, self._client._submit(group, stream=False, sink=sink))
            while pending:
                waited = partial(self._client.outage, [call for calls in pending.values() for call in calls])
                result = await sink.next(self._seconds(timeout), "any", waited)
                _done(pending, result.group_id)
                yield result
        finally:
            for call in [call for calls in pending.values() for call in calls]:
                self._abandon(call)

    def _seconds(self, timeout: float | None) -> float:
        if timeout is not None and not is_seconds(timeout):  # (the group is cancelled by the caller's finally)
            raise RolloutError(
                "bad_request", f"timeout must be a positive number of seconds, got {timeout!r}", "timeout"
            )
        return self._client.timeout if timeout is None else timeout


def _own(pending: dict[str, list[Call]], call: Call) -> None:
    """Count `call` among a generate_many's pending calls. A group may take an id again once the group that held it
    finished (the client refuses it only while that one runs: its error ends the call, and cancelling it, by its
    owner, leaves the first alone): each submission is waited for, and its result yielded, once."""
    pending.setdefault(call.group.group_id, []).append(call)


def _done(pending: dict[str, list[Call]], group_id: str) -> None:
    """A result of `group_id` came: its oldest submission is done (the same id is only taken again once the group
    holding it finished, so its results come in submission order)."""
    calls = pending.get(group_id)
    if calls:
        calls.pop(0)
        if not calls:
            del pending[group_id]
