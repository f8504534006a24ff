"""What one weight push keeps per worker (`PushLink`: its state, as its worker's replies move it) and the two ways a
wait for replies ends early."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rollout import protocol as p


@dataclass
class PushLink:
    """One worker's side of a push."""

    index: int
    address: str
    transport: str = "frames"
    specs: dict[str, tuple[str, tuple[int, ...]]] | None = None
    base_id: str | None = None  # the base weights it serves, as named by the last whole push (None: unnamed)
    base_aliases: list[str] = field(default_factory=list)  # other names of the same weights, bit for bit
    policy_version: int = 0  # the version it serves (its weights_spec_reply's)
    ready: p.WeightsReady | None = None
    committed: p.WeightsCommitted | None = None
    open: bool = False  # begun, neither committed nor rejected
    attached: bool = False  # its transport reached the worker's staging (`Sender.attach`) since its last begin
    pending: deque = field(default_factory=deque)  # buckets sent, not acknowledged (their data kept alive)

    def holds_base(self, base_id: str | None) -> bool:
        """Whether its worker serves the base named `base_id` (under that name or another of the same weights)."""
        return base_id == self.base_id or base_id in self.base_aliases

    def take(self, message: p.WorkerMessage) -> None:
        """Record its worker's reply to the push.

        Args:
            message: the worker's reply (an error, the spec, ready, an acknowledgement or committed).
        Raises:
            WorkerFailed: the worker answered with an error.
        """
        if isinstance(message, p.Error):
            self.open = False
            raise WorkerFailed(self, message)
        if isinstance(message, p.WeightsSpecReply):
            self.specs = {spec.name: (spec.dtype, tuple(spec.shape)) for spec in message.tensors}
            self.base_id, self.policy_version = message.base_id, message.policy_version
            self.base_aliases = list(message.base_aliases)
        elif isinstance(message, p.WeightsReady):
            self.ready = message
        elif isinstance(message, p.WeightsAck):
            if message.state == "staging" and self.pending:
                self.pending.popleft()
        elif isinstance(message, p.WeightsCommitted):
            self.committed = message
            self.open = False

    def loss_cause(self, bucket_bytes: int) -> str:
        """What a loss of its worker may come from, said in the push's error: with buckets in flight over frames, a
        frame over the worker's --max-message-bytes, which closes the connection before the worker can answer.

        Args:
            bucket_bytes: the push's largest bucket (and frame).
        """
        if self.transport != "frames" or not self.pending:
            return ""
        return (
            f"; its connection closed with buckets of this push in flight: a frame over the worker's "
            f"--max-message-bytes closes it (this push's bucket_bytes is {bucket_bytes}: lower it, or raise the limit)"
        )


class NoReply(Exception):
    """No reply within a short poll."""


class WorkerFailed(Exception):
    """A worker answered the push with an error."""

    def __init__(self, link: PushLink, error: p.Error):
        super().__init__(error.message)
        self.link = link
        self.error = error
