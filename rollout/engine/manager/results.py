"""Where a manager's outputs go: a queue callers read (`get_result`, `request_id_iter`, iteration), or a handler
registered for the request. A handler registered from a coroutine runs on that coroutine's event loop (through
`call_soon_threadsafe`, as transformers' manager does); one registered from plain code runs on the engine thread.

All state here is guarded by the manager's condition variable, which the router shares.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rollout.engine.requests.outputs import GenerationOutput
from rollout.engine.requests.request import sample_id
from rollout.validation import FieldError

logger = logging.getLogger(__name__)

Handler = Callable[[GenerationOutput], None]


@dataclass
class _Handler:
    callback: Handler
    loop: asyncio.AbstractEventLoop | None  # the registering coroutine's loop; None: call on the engine thread


@dataclass
class _Group:
    """State of one added request (a group of n samples) until its last output was read."""

    sample_ids: list[str]
    unfinished: int  # samples the engine has not finished
    unread: int  # finished samples whose final output nobody has taken yet
    handler: _Handler | None = None
    read: set[str] = field(default_factory=set)  # samples whose final output was taken (or handed to the handler)


class ResultRouter:
    """Routes outputs to waiting readers or registered handlers; forgets a request once all its outputs are read."""

    def __init__(self, state: threading.Condition):
        """
        Args:
            state: the manager's condition variable (re-entrant: handlers may call back in); it guards this object.
        """
        self.state = state
        self._results: deque[GenerationOutput] = deque()
        self._groups: dict[str, _Group] = {}
        self._sample_groups: dict[str, str] = {}  # sample id "<group>#<i>" -> group id, for groups of n > 1
        self._early_handlers: dict[str, _Handler] = {}  # registered before add_request

    # ---- requests (callers hold `state`) ------------------------------------------------------------------------
    def is_open(self, group_id: str) -> bool:
        """True while a request of this id has outputs not yet finished or read."""
        return group_id in self._groups

    def open(self, group_id: str, size: int) -> None:
        """Start routing a new request of `size` samples."""
        sample_ids = [group_id] if size == 1 else [sample_id(group_id, i) for i in range(size)]
        self._groups[group_id] = _Group(sample_ids, size, size, self._early_handlers.pop(group_id, None))
        self._sample_groups.update((sid, group_id) for sid in sample_ids if sid != group_id)

    def group_of(self, request_id: str | None) -> str | None:
        """The request (group) id of a request or sample id, None when unknown or done."""
        with self.state:
            if request_id in self._groups:
                return request_id
            return self._sample_groups.get(request_id)

    def unread_samples(self, request_id: str) -> int:
        """How many samples of the request have a final output nobody read yet (for one sample's id: 1 or 0)."""
        with self.state:
            group = self._groups.get(request_id)
            if group is not None:
                return group.unread
            group_id = self._sample_groups.get(request_id)
            return int(group_id is not None and request_id not in self._groups[group_id].read)

    # ---- handlers -----------------------------------------------------------------------------------------------
    def register_handler(self, request_id: str, callback: Handler) -> None:
        """See `ContinuousBatchingManager.register_result_handler`."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # plain code: the engine thread calls it
            loop = None
        handler = _Handler(callback, loop)
        with self.state:
            group_id = self.group_of(request_id)
            if group_id is None:  # not added yet: add_request picks it up (a sample's id names its request's)
                self._early_handlers[request_id.split("#", 1)[0]] = handler
                return
            waiting = [output for output in self._results if output.group_id == group_id]
            for output in waiting:
                self._results.remove(output)
            self._groups[group_id].handler = handler
            for output in waiting:
                self._call(handler, output)
                if output.is_finished:
                    self._mark_read(output)

    def _call(self, handler: _Handler, output: GenerationOutput) -> None:
        if handler.loop is None:
            _run_callback(handler.callback, output)
            return
        try:
            handler.loop.call_soon_threadsafe(_run_callback, handler.callback, output)
        except RuntimeError:  # the loop was closed: nobody is listening any more
            logger.warning("result handler of %s dropped an output: its event loop is closed", output.group_id)

    # ---- reading ------------------------------------------------------------------------------------------------
    def get(
        self, request_id: str | None, timeout: float | None, running: Callable[[], bool], until_read: bool = False
    ) -> GenerationOutput | None:
        """See `ContinuousBatchingManager.get_result`; `running` says whether more outputs may still come;
        `until_read`: also None once every final output of `request_id` was read (by another reader)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.state:
            while True:
                for output in self._results:
                    if request_id is None or request_id in (output.group_id, output.request_id):
                        self._results.remove(output)
                        if output.is_finished:
                            self._mark_read(output)
                        return output
                if not running() or (until_read and not self.unread_samples(request_id)):
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self.state.wait(0.1 if remaining is None else min(remaining, 0.1))

    def iter_request(
        self, request_id: str, timeout: float | None, running: Callable[[], bool]
    ) -> Iterator[GenerationOutput]:
        """See `ContinuousBatchingManager.request_id_iter`."""
        samples_left = self.unread_samples(request_id)
        if not samples_left:  # a typo'd id would otherwise look like a request that finished with no output
            reason = f"{request_id!r} has no output left to read: it was never added, or every output was read"
            raise FieldError("request_id", reason)
        with self.state:
            group = self._groups.get(self.group_of(request_id) or "")
            if group is not None and group.handler is not None:  # nothing would ever come here
                reason = f"{request_id!r}: its outputs go to the handler registered for it (register_result_handler)"
                raise FieldError("request_id", reason)
        while samples_left:
            output = self.get(request_id, timeout, running, until_read=True)
            if output is None:
                if not self.unread_samples(request_id):  # another reader took its last outputs: nothing comes
                    return
                if not running():
                    reason = "the manager is not running (start() it first, or it was stopped)"
                    raise TimeoutError(f"request {request_id!r}: {reason}, and none of its outputs is waiting")
                raise TimeoutError(f"request {request_id!r}: no output within {timeout} s")
            samples_left -= output.is_finished
            yield output

    # ---- delivery (engine thread) -------------------------------------------------------------------------------
    def deliver(self, outputs: list[GenerationOutput]) -> None:
        """Hand outputs to their request's handler, or queue them for readers."""
        if not outputs:
            return
        with self.state:
            for output in outputs:
                group = self._groups.get(output.group_id)
                if group is not None and group.handler is not None:
                    self._call(group.handler, output)
                    if output.is_finished:
                        self._mark_read(output)
                else:
                    self._results.append(output)
                if output.is_finished and group is not None:
                    group.unfinished -= 1
                    self._forget_if_done(output.group_id)
            self.state.notify_all()

    def _mark_read(self, output: GenerationOutput) -> None:
        group = self._groups.get(output.group_id)
        if group is not None:
            group.unread -= 1
            group.read.add(output.request_id)
            self._forget_if_done(output.group_id)

    def _forget_if_done(self, group_id: str) -> None:
        group = self._groups[group_id]
        if group.unfinished <= 0 and group.unread <= 0:
            del self._groups[group_id]
            for sid in group.sample_ids:
                self._sample_groups.pop(sid, None)


def _run_callback(callback: Handler, output: GenerationOutput) -> None:
    try:
        callback(output)
    except Exception:  # noqa: BLE001 - a user callback must not kill the engine thread or the caller's loop
        logger.exception("result handler for %s raised", output.group_id)
