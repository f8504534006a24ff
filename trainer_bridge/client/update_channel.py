"""A weight update's link to the workers through a RolloutClient: raw sends to chosen workers, and every reply that
carries the update's id (the push in push.py drives it)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from rollout import protocol as p
from trainer_bridge.client.calls import RolloutError
from trainer_bridge.client.closing_waits import get_unless_closed
from trainer_bridge.client.commands import CloseChannel, SendRaw


class UpdateChannel:
    """One weight update's link to the workers (see `RolloutClient.open_update_channel`)."""

    def __init__(
        self,
        command: Callable[[Any], None],
        closed: Callable[[str], None],
        update_id: str,
        replies: queue.SimpleQueue,
        client_closed: threading.Event,
    ):
        """
        Args:
            command: puts a command in the client's I/O thread's mailbox.
            closed: tells the client this update's channel is closed.
            update_id: the update whose replies the channel gets.
            replies: where the I/O thread puts them, as (worker index, message).
            client_closed: set when the client closes (its I/O thread, which puts the replies, ends).
        """
        self._command = command
        self._closed = closed
        self.update_id = update_id
        self._replies = replies
        self._client_closed = client_closed

    def send(self, worker: int, message: p.Message, data: list | None = None) -> None:
        """Send `message` (and raw data frames after its header) to worker `worker`."""
        self._command(SendRaw(worker, message, data))

    def receive(self, timeout: float) -> tuple[int, p.Message]:
        """The next reply of any worker to this update, as (worker index, message).

        Raises:
            RolloutError: code "timeout" when none came in time; "closed" at once when the client closed.
        """
        try:
            return get_unless_closed(self._replies, self._client_closed, timeout)
        except queue.Empty:
            raise RolloutError("timeout", f"weight update {self.update_id}: no answer within {timeout:.1f} s") from None

    def close(self) -> None:
        """Stop routing replies to this channel."""
        self._command(CloseChannel(self.update_id))
        self._closed(self.update_id)
