"""`UpdateCounts`: what a worker's weight updates added up to (`stats()`'s weight_updates_rejected,
weight_update_bytes and weight_update_pause_ms): updates refused over ZeroMQ or by the HTTP API's /update_weights
(counted from its threads too), the bytes and pauses of those committed either way."""

from __future__ import annotations

import threading


class UpdateCounts:
    """Updates refused or dropped, and the bytes and engine pauses of those committed (one lock: a `+=` from two
    threads may lose one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rejected = 0
        self.bytes_committed = 0
        self.pause_ms_total = 0.0

    def refused(self) -> None:
        """An update was refused or dropped (at its begin, mid-way, at commit; over ZeroMQ or /update_weights)."""
        with self._lock:
            self.rejected += 1

    def committed(self, nbytes: int, pause_ms: float) -> None:
        """An update of `nbytes` bytes was committed (over ZeroMQ or /update_weights), the engine paused `pause_ms`
        for it."""
        with self._lock:
            self.bytes_committed += nbytes
            self.pause_ms_total += pause_ms
