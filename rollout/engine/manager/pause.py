"""The manager's pause (transformers' `ContinuousBatchingManager.pause`): a caller asks, the engine thread stops
between two steps and waits until the caller's block ends; requests in flight and the KV cache are kept.

Callers from different threads take turns; a thread inside a pause may nest another (or another coroutine on its
event loop may pause), which the loop, already paused, grants at once. A pause asked for when the loop is ending, or
when it died, raises instead of waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PauseRequest:
    """One `pause()` waiting for, then holding, the engine loop."""

    paused: threading.Event = field(default_factory=threading.Event)  # set by the engine thread once paused
    release: threading.Event = field(default_factory=threading.Event)  # set by the caller when its block ends
    refused: str | None = None  # why the loop will never pause (it stopped first)


class PauseGate:
    """Both sides of the pause: `hold()` for callers, `serve()` for the engine thread."""

    def __init__(self, submit: Callable[[PauseRequest], None], running: Callable[[], bool], error: Callable[[], Any]):
        """
        Args:
            submit: hands a request to the engine thread (its command queue).
            running: whether the engine thread still runs.
            error: the engine thread's error, if it died of one.
        """
        self._submit = submit
        self._running = running
        self._error = error
        self._holders: dict[int, int] = {}  # thread ident -> depth of its `with pause():` blocks

    def held_here(self) -> bool:
        """True when the calling thread is inside a pause (so the loop waits for it)."""
        return threading.get_ident() in self._holders

    @contextmanager
    def hold(self, timeout: float | None) -> Iterator[None]:
        """Pause the loop for the block (see `ContinuousBatchingManager.pause`)."""
        me = threading.get_ident()
        if me in self._holders:  # nested: the loop is paused already
            self._holders[me] += 1
            try:
                yield
            finally:
                self._holders[me] -= 1
            return
        request = PauseRequest()
        self._submit(request)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not request.paused.is_set():
                if not self._running():
                    raise RuntimeError("the manager stopped before it could pause") from self._error()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"the engine loop did not pause within {timeout} s")
                request.paused.wait(0.1 if remaining is None else min(0.1, remaining))
            if request.refused:
                raise RuntimeError(f"cannot pause: {request.refused}") from self._error()
            self._holders[me] = 1
            try:
                yield
            finally:
                del self._holders[me]
        finally:
            request.release.set()  # also when the wait failed: a late pause then ends at once

    @staticmethod
    def serve(request: PauseRequest, stopping: bool, flush: Callable[[], None]) -> None:
        """Engine thread: finish the step in flight (`flush`), then wait for the caller to leave its block (a stop
        from elsewhere waits too: the caller may be using the model)."""
        if request.release.is_set():  # the caller gave up waiting
            return
        if stopping:  # asked before a stop, reached after it: the loop is ending, not pausing
            PauseGate.refuse(request, "the manager is stopping")
            return
        flush()
        request.paused.set()
        request.release.wait()

    @staticmethod
    def refuse(request: PauseRequest, reason: str) -> None:
        """Answer a pause the loop will never take."""
        request.refused = reason
        request.paused.set()
