"""A weight update's link to the workers through a RolloutClient: raw sends to chosen workers, and every reply that
carries the update's id (the push in push.py drives it)."""

from __future__ import annotations

import queue
from typing import TYPE_CHECKING

from rollout.service import protocol as p
from trainer_bridge.calls import RolloutError
from trainer_bridge.commands import CloseChannel, SendRaw

if TYPE_CHECKING:
    from trainer_bridge.client import RolloutClient


class UpdateChannel:
    """One weight update's link to the workers (see `RolloutClient.open_update_channel`)."""

    def __init__(self, client: RolloutClient, update_id: str, replies: queue.SimpleQueue):
        self.client = client
        self.update_id = update_id
        self._replies = replies

    def send(self, worker: int, message: p.Message, data: list | None = None) -> None:
        """Send `message` (and raw data frames after its header) to worker `worker`."""
        self.client._io.command(SendRaw(worker, message, data))

    def receive(self, timeout: float) -> tuple[int, p.Message]:
        """The next reply of any worker to this update, as (worker index, message).

        Raises:
            RolloutError: code "timeout" when none came in time.
        """
        try:
            return self._replies.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise RolloutError("timeout", f"weight update {self.update_id}: no answer within {timeout:.1f} s") from None

    def close(self) -> None:
        """Stop routing replies to this channel."""
        self.client._io.command(CloseChannel(self.update_id))
        self.client._update_closed(self.update_id)
