"""A queue that takes turns between clients: each client's items in the order it sent them, the clients round
robin, so a client with a hundred items waiting delays another client's one by at most one item per slot. Bounded
per client and in all; a client may also be held to a number of items taken at once (`max_running_per_client`),
so that one client never holds every slot.

Not thread-safe by itself: its owner holds a lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Generic, TypeVar

Item = TypeVar("Item")


class QueueBusy(Exception):
    """The queue is full, for this client or in all (the message says which)."""


class FairQueue(Generic[Item]):
    """Per-client FIFO queues served round robin."""

    def __init__(self, max_waiting: int, max_waiting_per_client: int, max_running_per_client: int):
        """
        Args:
            max_waiting: most items waiting (all clients together).
            max_waiting_per_client: most items one client may have waiting or taken.
            max_running_per_client: most items of one client taken (`pop`) and not yet `done`.
        """
        self.max_waiting = max_waiting
        self.max_waiting_per_client = max_waiting_per_client
        self.max_running_per_client = max_running_per_client
        self._queues: OrderedDict[Hashable, deque[Item]] = OrderedDict()  # clients in turn order, next first
        self._running: dict[Hashable, int] = {}
        self._waiting = 0

    def push(self, client: Hashable, item: Item) -> None:
        """Queue `item` behind `client`'s others.

        Raises:
            QueueBusy: the queue or this client's share of it is full.
        """
        if self._waiting >= self.max_waiting:
            raise QueueBusy(f"{self.max_waiting} structured-output constraints are waiting to compile; retry later")
        mine = len(self._queues.get(client, ())) + self._running.get(client, 0)
        if mine >= self.max_waiting_per_client:
            reason = f"this client already has {mine} structured-output constraints compiling or waiting to compile"
            raise QueueBusy(f"{reason} (this worker's --max-compiles-per-client); retry later")
        self._queues.setdefault(client, deque()).append(item)
        self._waiting += 1

    def pop(self) -> tuple[Hashable, Item] | None:
        """The next client's oldest item (that client then goes last in turn), or None: nothing waits, or every
        waiting client already has `max_running_per_client` items taken."""
        for client, items in self._queues.items():
            if self._running.get(client, 0) < self.max_running_per_client:
                item = items.popleft()
                self._waiting -= 1
                self._running[client] = self._running.get(client, 0) + 1
                del self._queues[client]
                if items:
                    self._queues[client] = items  # last in turn
                return client, item
        return None

    def done(self, client: Hashable) -> None:
        """An item `pop` gave for `client` is finished (its slot is free for the next)."""
        left = self._running.get(client, 0) - 1
        if left > 0:
            self._running[client] = left
        else:
            self._running.pop(client, None)

    def remove(self, client: Hashable, item: Item) -> bool:
        """Take a waiting item out (False: it is not waiting: taken already, or never queued)."""
        items = self._queues.get(client)
        if items is None:
            return False
        try:
            items.remove(item)
        except ValueError:
            return False
        self._waiting -= 1
        if not items:
            del self._queues[client]
        return True

    def drain(self) -> list[Item]:
        """Take out every waiting item (the queue is stopping)."""
        items = [item for queue in self._queues.values() for item in queue]
        self._queues.clear()
        self._waiting = 0
        return items

    @property
    def num_waiting(self) -> int:
        """Items waiting (not taken)."""
        return self._waiting
