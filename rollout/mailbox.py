"""Draining a thread's mailbox: every thread that owns something (the engine thread, the worker's serving thread,
the client's I/O thread) takes work from a `queue.SimpleQueue` that other threads fill, all of it at once."""

from __future__ import annotations

import queue
from typing import TypeVar

Item = TypeVar("Item")


def drain(mailbox: queue.SimpleQueue[Item], wait_s: float | None = None) -> list[Item]:
    """Everything in `mailbox` now, oldest first; with `wait_s`, first wait up to that long for one item (an empty
    list when none came).

    Args:
        mailbox: the queue to empty.
        wait_s: seconds to wait for the first item; None: do not wait.
    """
    items: list[Item] = []
    try:
        items.append(mailbox.get(timeout=wait_s) if wait_s is not None else mailbox.get_nowait())
        while True:
            items.append(mailbox.get_nowait())
    except queue.Empty:
        return items
