"""`SlotsInFlight`: `AsyncRollouts`' prompt groups by slot (their index in the prompt order), each sent through the
client and answered once per send. A slot sent again (after an abort, or when stale) gets a new send: an answer to an
older send is dropped, and so is one whose slot is gone, since ids alone cannot say which send an answer is for (a
group id may come again once the group holding it finished: a stable id per prompt, repeated each epoch)."""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator
from typing import Any

from trainer_bridge.client.calls import GroupResult, PromptGroup, RolloutError, timed_out


class SlotsInFlight:
    """The slots taken from the prompt groups and not forgotten yet, their latest sends and the ids still running."""

    def __init__(self, client: Any, groups: Iterable[PromptGroup], timeout: float):
        """
        Args:
            client: the `RolloutClient` that sends them.
            groups: the prompt groups, in training order (read as far ahead as slots are taken).
            timeout: most seconds `next_result` waits for one answer.
        """
        self.client = client
        self.timeout = timeout
        self.num_taken = 0  # groups taken from `groups` so far (the next slot's index)
        self._source: Iterator[PromptGroup] = iter(groups)
        self._exhausted = False
        # (slot, send, event): the GroupResults and RolloutErrors of submitted groups, each tagged by its `_SlotSink`.
        self._sink: queue.SimpleQueue = queue.SimpleQueue()
        self._groups: dict[int, PromptGroup] = {}  # each slot's group as the client checked it (id and seed set)
        self._sends: dict[int, object] = {}  # each slot's latest send (`_SlotSink.send`)
        self._running: set[str] = set()  # ids of the groups sent and not answered (cancelled on close)

    def send_next(self) -> int | None:
        """Take the next group into the next slot and send it; its slot, or None when the groups ran out."""
        if self._exhausted:
            return None
        try:
            group = next(self._source)
        except StopIteration:
            self._exhausted = True
            return None
        self._groups[self.num_taken] = group
        self.num_taken += 1
        self.send(self.num_taken - 1)
        return self.num_taken - 1

    def send(self, index: int) -> None:
        """Send slot `index`'s group (again: the same prompt and seed); an answer to its earlier send is dropped."""
        sink = _SlotSink(self._sink, index)
        call = self.client._submit(self._groups[index], stream=False, sink=sink)  # noqa: SLF001 - same package
        self._groups[index] = call.group  # its id and seed, kept for a regeneration
        self._sends[index] = sink.send
        self._running.add(call.group.group_id)

    def next_result(self) -> tuple[int, GroupResult] | None:
        """Wait for one answer: (its slot, the result), or None when it answers an older send or a forgotten slot.

        Raises:
            RolloutError: a timeout (naming why no worker serves), or the client's error for a group.
        """
        try:
            index, send, event = self._sink.get(timeout=self.timeout)
        except queue.Empty:
            raise timed_out(f"no group finished within {self.timeout:g} s", self.client.outage()) from None
        if isinstance(event, RolloutError):
            try:
                raise event
            finally:  # the traceback keeps this frame, not the error: no cycle to collect
                event = None
        current = self._sends.get(index)
        if current is None or current is send:  # (not a newer send's id: the client may take an id again)
            self._running.discard(event.group_id)
        if current is not send:
            return None  # a group already trained on, or sent again since (never expected: each result comes once)
        return index, event

    def forget(self, index: int) -> None:
        """Done with slot `index` (trained on): a long run must not keep every prompt."""
        del self._groups[index], self._sends[index]

    def cancel_running(self) -> None:
        """Cancel every group sent and not answered."""
        for group_id in list(self._running):
            self.client.cancel(group_id)
        self._running.clear()


class _SlotSink:
    """Where the client puts one send's events: into the slots' queue, tagged with its slot and the send."""

    def __init__(self, sink: queue.SimpleQueue, index: int):
        self._sink = sink
        self._index = index
        self.send = object()  # this send (a slot sent again, after an abort or when stale, gets a new one)

    def put(self, event: Any) -> None:
        self._sink.put((self._index, self.send, event))
