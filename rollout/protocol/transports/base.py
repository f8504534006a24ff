"""The interface every weight transport implements: a `Sender` (the trainer's half, one per push) and a `Receiver`
(the worker's half, one per worker, as long-lived as its update slot).

The phases both halves go through, in order (the wire messages are in `rollout.protocol`):

    trainer (Sender)                               worker (Receiver)
    begin_fields(rank) -> weights_begin's `dist`    check_begin(begin, peer); staging(pool, nbytes)
    joined() once every begin went out              when_ready(begin, reply, cancelled) -> weights_ready
    attach(link, ready, specs) per ready worker
    per bucket: stage(bucket) once, then
                send_bucket(link, header, bucket)   accept_bucket(area, pieces, frames)   (serving thread)
                then bucket_sent(bucket)            take_bytes(area, begin, pieces, frames, checksum) (job thread)
    close()                                         ended(begin, clean); close()

Both halves see the rest of the update through small duck-typed interfaces (`StagingArea`, `PushContext`), so this
package imports neither the worker nor the trainer side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rollout.protocol.weight_messages import TensorPiece, TensorSpec, WeightsBegin, WeightsBucket, WeightsReady


class UpdateRejected(Exception):
    """A weight update that cannot go on; the worker answers with an Error carrying `code` and `field`."""

    def __init__(self, code: str, field: str | None, reason: str):
        super().__init__(f"{field}: {reason}" if field else reason)
        self.code = code
        self.field = field
        self.reason = reason


class StagingArea(Protocol):
    """What a receiver writes into: one open update's staging area on the worker (`StagedUpdate`)."""

    specs: list[TensorSpec]  # the announced tensors
    sizes: list[int]  # their bytes
    offsets: list[int]  # where each starts in `staging`
    staging: torch.Tensor  # uint8 bytes

    def announce(self, pieces: list[TensorPiece]) -> None: ...
    def staging_views(self, pieces: list[TensorPiece]) -> list[torch.Tensor]: ...
    def verify(self, pieces: list[TensorPiece], chunks: list, checksum: int | None) -> None: ...
    def check_segment(self) -> None: ...
    def copy_from_segment(self, pieces: list[TensorPiece]) -> list[torch.Tensor]: ...
    def stage(self, piece: TensorPiece, data: torch.Tensor) -> None: ...
    def mark_received(self, pieces: list[TensorPiece]) -> None: ...


class PushContext(Protocol):
    """What a sender acts for: one push on the trainer (`WeightPush`)."""

    timeout: float  # seconds per phase
    links: list[Any]  # the workers' sides of the push (`PushLink`: index, address, ...)
    channel: Any  # the client's update channel: send(worker index, message, frames=None)
    dist_host: str | None  # torch.distributed: the address the workers reach this process at (None: found)
    dist_backend: str  # torch.distributed: "gloo" or "nccl"

    def watch_replies(self, seconds: float) -> None:
        """Read the workers' replies for up to `seconds`; a refusal raises at once."""


class Sender:
    """The trainer's half of a transport, one per push. The defaults fit a transport that sends each worker its
    bytes on its own (frames, shm); torch.distributed overrides the push-wide steps."""

    # A bucket's bytes may stay on the device they were gathered on (a broadcast from GPU memory); else host bytes.
    bytes_on_device = False
    # A worker lost mid-push leaves the others to finish (False: the transport needs every worker to the end).
    survives_a_lost_worker = True

    def __init__(self, push: PushContext):
        self.push = push

    def begin_fields(self, rank: int) -> dict[str, Any]:
        """The `dist` field of the weights_begin sent to the worker at `rank` (1, 2, ...): empty unless the
        transport needs a rendezvous."""
        return {}

    def joined(self) -> None:
        """Called once every worker was sent its weights_begin (a group transport joins its group here)."""

    def attach(self, link: Any, ready: WeightsReady, specs: list[TensorSpec]) -> None:
        """Called when a worker answered weights_ready, before any bucket goes to it.

        Raises:
            OSError: the worker's staging cannot be reached from here (the push may fall back to frames).
        """

    def stage(self, bucket: list[tuple[int, int, torch.Tensor]], offsets: list[int]) -> list[torch.Tensor] | None:
        """Called once per bucket, before its header goes to any worker: put its bytes where this transport's workers
        read them by themselves (shm: their segments). Returns the bytes on the host as they were placed from, in the
        bucket's order (its checksum is computed from them, sparing another device-to-host copy), or None (the
        default: nothing placed).

        Args:
            bucket: (tensor index, byte offset in the tensor, bytes) per piece.
            offsets: each tensor's byte offset in the staging layout.
        """
        return None

    def send_bucket(
        self, link: Any, header: WeightsBucket, bucket: list[tuple[int, int, torch.Tensor]], offsets: list[int]
    ) -> Any:
        """Send one bucket to one worker; returns what must stay alive until the worker acknowledges it.

        Args:
            link: the worker's side of the push.
            header: the bucket's weights_bucket message.
            bucket: (tensor index, byte offset in the tensor, bytes) per piece.
            offsets: each tensor's byte offset in the staging layout.
        """
        raise NotImplementedError

    def bucket_sent(self, bucket: list[tuple[int, int, torch.Tensor]], offsets: list[int]) -> None:
        """Called once every worker was sent the bucket's header (a group transport broadcasts the bytes here)."""

    def close(self) -> None:
        """Release what this transport holds for the push (at its end, whatever happened)."""


class Receiver:
    """The worker's half of a transport, one per worker, living as long as its update slot."""

    def __init__(self, device: torch.device):
        """
        Args:
            device: the device the worker's model is on (a transport may receive there, e.g. NCCL).
        """
        self.device = device

    # An update that ended unclean (rejected, aborted) may give its staging back for reuse only where its own jobs
    # alone wrote it (True for frames). False (the safe default) where someone else may still write into it: a
    # client into a shared segment, an abandoned broadcast.
    staging_reusable_after_abort = False

    def check_begin(self, begin: WeightsBegin, peer: str | None) -> None:
        """Check the transport's own fields of a weights_begin.

        Raises:
            UpdateRejected: naming the field.
        """

    def staging(self, pool: Any, nbytes: int) -> tuple[torch.Tensor, tuple[Any, torch.Tensor] | None]:
        """The staging area of a new update, from the worker's `StagingPool`: a host buffer of the worker's own, and
        for a transport whose client writes the bytes in place, a shared-memory segment and a uint8 view of it (else
        None), each at least `nbytes` long.

        Raises:
            UpdateRejected: none can be made.
        """
        return pool.host(nbytes), None

    def when_ready(
        self, begin: WeightsBegin, reply: Callable[[BaseException | None], None], cancelled: Callable[[], bool]
    ) -> bool:
        """Whether the update may receive buckets now (True: the caller answers weights_ready at once). False: this
        transport calls `reply(None)` (or `reply(error)`) from a thread of its own once it may, unless `cancelled()`
        became true first."""
        return True

    def accept_bucket(self, area: StagingArea, pieces: list[TensorPiece], frames: list) -> None:
        """Check a bucket's structure on the serving thread and count its pieces as announced (no byte is read).

        Raises:
            UpdateRejected: naming what was wrong.
        """
        if frames:
            raise UpdateRejected("bad_update", "frames", 'only transport "frames" sends data frames')
        area.announce(pieces)

    def take_bytes(
        self, area: StagingArea, begin: WeightsBegin, pieces: list[TensorPiece], frames: list, checksum: int | None
    ) -> None:
        """Bring the bucket's bytes into the staging area and check them (on the update's job thread).

        Raises:
            UpdateRejected: bytes that do not match the checksum, or a failed transfer.
        """
        raise NotImplementedError

    def ended(self, begin: WeightsBegin, clean: bool) -> None:
        """The update of this transport ended (committed, or not: `clean`)."""

    def close(self) -> None:
        """At the worker's shutdown."""


@dataclass(frozen=True)
class WeightTransport:
    """One transport: its wire name and its two halves."""

    name: str
    sender: type[Sender]
    receiver: type[Receiver]
