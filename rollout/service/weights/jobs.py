"""Serial background jobs: one daemon thread that runs callables in the order they were queued.

The worker's serving thread must answer every client within a bounded time, so work whose cost grows with an
update's size (hashing a bucket, staging its bytes, a NaN check over every tensor, a torch.distributed receive or
rendezvous) runs on one of these. Order matters: a commit's checks run after every bucket queued before it.
The thread is a daemon, so a job stuck in a collective cannot hold up the interpreter's exit.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class SerialJobs:
    """Runs queued jobs one after another on a thread of its own (started at the first job)."""

    def __init__(self, name: str):
        """
        Args:
            name: the thread's name (shown by debuggers and `py-spy`).
        """
        self.name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping: threading.Thread | None = None  # the thread `close` told to stop
        self._lock = threading.Lock()
        self._pending = 0  # queued or running

    def submit(self, job: Callable[[], None]) -> None:
        """Queue `job`; it runs after every job queued before it. An exception it raises is logged, never fatal."""
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._queue.put(job)

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        return self._pending

    def close(self) -> None:
        """Stop the thread after the jobs already queued (it is not waited for)."""
        with self._lock:
            if self._thread is not None:
                self._queue.put(None)
                self._stopping, self._thread = self._thread, None

    def join(self, timeout_s: float) -> bool:
        """After `close`: wait up to `timeout_s` for the queued jobs to end. True when they did."""
        thread = self._stopping
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - a failing job must not end the thread
                logger.exception("background job of %s failed", self.name)
            finally:
                with self._lock:
                    self._pending -= 1
