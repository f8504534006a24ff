"""Structured-output constraints compiled off the worker's serving loop.

Compiling a grammar against a production vocabulary takes milliseconds for a typical JSON schema, but a regular
expression with large repetition counts (`[a-z]{1,2000}`) takes seconds: a client could stall every other client's
requests if the serving loop compiled. So a group with a constraint is compiled on a small pool of threads (xgrammar
releases the GIL while it compiles; its cache makes the engine's own compile of the same spec instant), and admitted
by the serving loop once compiled, in the order compiles finish.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")

COMPILE_THREADS = 2  # slow specs occupy these; unconstrained groups never wait for them


class ConstraintCompiles(Generic[Item]):
    """Compiles on a thread pool; the serving thread collects what finished (`ready`) and admits it."""

    def __init__(self, compile_constraint: Callable[[Any], object], wake: Callable[[], None]):
        """
        Args:
            compile_constraint: compiles a SamplingParams' constraint (raising FieldError for a bad spec).
            wake: wakes the serving loop's poll (called from a pool thread when a compile finished).
        """
        self._compile = compile_constraint
        self._wake = wake
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="rollout-compile")
        self._done: queue.SimpleQueue[tuple[Item, BaseException | None]] = queue.SimpleQueue()
        self._pending: dict[Future, Item] = {}
        self._lock = threading.Lock()

    def submit(self, item: Item, sampling: Any) -> None:
        """Compile `sampling`'s constraint; `item` (what the caller needs to admit it) comes back from `ready`."""
        with self._lock:
            future = self._pool.submit(self._run, sampling)
            self._pending[future] = item
        future.add_done_callback(self._finished)

    def _run(self, sampling: Any) -> None:
        self._compile(sampling)

    def _finished(self, future: Future) -> None:
        with self._lock:
            item = self._pending.pop(future, None)
        if item is None or future.cancelled():
            return  # close() answers it
        self._done.put((item, future.exception()))
        self._wake()

    def ready(self) -> list[tuple[Item, BaseException | None]]:
        """The items whose compile finished since the last call, each with its error (None: compiled)."""
        finished = []
        while True:
            try:
                finished.append(self._done.get_nowait())
            except queue.Empty:
                return finished

    @property
    def num_pending(self) -> int:
        """Compiles queued or running."""
        with self._lock:
            return len(self._pending)

    def close(self) -> list[Item]:
        """Stop: cancel the compiles not started, wait for those running (a compile cannot be interrupted).

        Returns:
            Every item never handed out by `ready`: the caller tells their clients.
        """
        with self._lock:
            left = list(self._pending.values())
        self._pool.shutdown(wait=True, cancel_futures=True)
        left += [item for item, _ in self.ready()]
        with self._lock:
            self._pending.clear()
        return list({id(item): item for item in left}.values())
