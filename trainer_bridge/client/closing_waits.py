"""Waits of a RolloutClient's callers on what its I/O thread answers (stats, a weight update's replies), which end
with RolloutError "closed" as soon as the client closes: the I/O thread is gone then and nothing more would come, so
waiting out the timeout and calling it one would hide why."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from trainer_bridge.client.calls import RolloutError

SLICE_S = 0.05  # how often a wait looks whether the client closed


def get_unless_closed(replies: queue.SimpleQueue, closed: threading.Event, timeout: float) -> Any:
    """The next item of `replies`, waiting at most `timeout` seconds (an item put before the close is still taken).

    Args:
        replies: where the I/O thread puts its answers.
        closed: the client's closed event.
        timeout: most seconds to wait.
    Raises:
        queue.Empty: nothing came in time.
        RolloutError: "closed" when the client closed first.
    """
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        try:
            return replies.get(timeout=min(SLICE_S, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            if closed.is_set():
                try:
                    return replies.get_nowait()
                except queue.Empty:
                    raise RolloutError("closed", "the client was closed") from None
            if time.monotonic() >= deadline:
                raise
