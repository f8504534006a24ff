"""Transport "shm": the worker makes a shared-memory segment (named in weights_ready) that the trainer writes each
bucket into (from a GPU through one page-locked buffer), then sends the bucket's header; the worker copies the
bucket out into its own staging buffer and checks it there. Same host only. A trainer that cannot open the segment
(another host) fails the push, or with transport "auto" falls back to frames."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from rollout.protocol.staging import attach_shared_memory, staging_layout
from rollout.protocol.transports.base import Receiver, Sender, StagingArea, UpdateRejected, WeightTransport
from rollout.protocol.weight_messages import TensorPiece, TensorSpec, WeightsBegin, WeightsBucket, WeightsReady


class ShmSender(Sender):
    bytes_on_device = True  # a GPU's bytes are gathered into a page-locked buffer here, no further (`stage`)

    def __init__(self, push: Any):
        super().__init__(push)
        self._segments: dict[int, tuple[Any, torch.Tensor]] = {}  # per worker index: the segment and a view of it
        self._bounce: torch.Tensor | None = None  # page-locked: a GPU's bytes on their way into the segments

    def attach(self, link: Any, ready: WeightsReady, specs: list[TensorSpec]) -> None:
        expected = staging_layout(specs)[1]
        if not ready.shm_name:
            raise OSError("the worker named no shared-memory segment")
        segment = attach_shared_memory(ready.shm_name)
        if segment.size < expected:
            segment.close()
            raise OSError(f"segment of {segment.size} bytes, expected {expected}")
        self._segments[link.index] = (segment, torch.frombuffer(segment.buf, dtype=torch.uint8))

    def stage(self, bucket: list[tuple[int, int, torch.Tensor]], offsets: list[int]) -> list[torch.Tensor] | None:
        """Copy the bucket into the segment of every worker still in the push over shm; returns its bytes on the host
        as they were copied from (the checksum is computed from them, so the worker's check still covers the copy
        into its segment). Each bucket has its own place in the segments, so a bucket staged while earlier ones are
        still being checked by the worker overwrites nothing it reads."""
        live = [  # not a lost worker's, nor one that went over to frames after its segment was attached
            (link.address, *self._segments[link.index])
            for link in self.push.links
            if link.transport == "shm" and link.index in self._segments
        ]
        if not live:
            return None
        sources = self._on_host([data for _, _, data in bucket])
        end = max(offsets[index] + offset + data.numel() for index, offset, data in bucket)
        for address, segment, staging in live:
            _check_size(address, segment, end)
            for (index, offset, _), source in zip(bucket, sources):
                staging[offsets[index] + offset :][: source.numel()].copy_(source)
        return sources

    def _on_host(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """The pieces on the host: a GPU's through one page-locked bounce buffer, kept for the push (a copy into
        the unlocked segment would crawl through the driver's own small bounce buffer, several times slower)."""
        if not any(piece.is_cuda for piece in pieces):
            return pieces
        total = sum(piece.numel() for piece in pieces)
        if self._bounce is None or self._bounce.numel() < total:
            self._bounce = None
            self._bounce = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        hosted, start = [], 0
        for piece in pieces:
            hosted.append(self._bounce[start : start + piece.numel()].copy_(piece, non_blocking=True))
            start += piece.numel()
        for device in {piece.device for piece in pieces if piece.is_cuda}:
            torch.cuda.synchronize(device)
        return hosted

    def send_bucket(
        self, link: Any, header: WeightsBucket, bucket: list[tuple[int, int, torch.Tensor]], offsets: list[int]
    ) -> Any:
        self.push.channel.send(link.index, header)  # its bytes are in the worker's segment (`stage`)
        return None

    def close(self) -> None:
        self._bounce = None  # back to torch's pinned-memory cache (the next push reuses it)
        for index in list(self._segments):
            self._release(index)

    def _release(self, index: int) -> None:
        kept = self._segments.pop(index, None)
        if kept is not None:
            segment, view = kept
            del view, kept  # the segment's buffer stays exported while a view of it lives
            with contextlib.suppress(BufferError):
                segment.close()


def _check_size(address: str, segment: Any, end: int) -> None:
    """Refuse to write up to byte `end` of a worker's segment that no longer reaches it: writing past the end of a
    truncated segment ends this process with SIGBUS. A process that truncates it in the instant between this check
    and the copy is beyond it (as on the worker, over "shm" the processes of its user on the host are trusted).

    Raises:
        UpdateRejected: field "transport", naming the worker and the segment's size.
    """
    size = os.fstat(segment._fd).st_size  # noqa: SLF001 - SharedMemory keeps its descriptor open on POSIX
    if size < end:
        raise UpdateRejected(
            "bad_update",
            "transport",
            f"{address}'s shared-memory segment {segment.name} shrank to {size} bytes, under the {end} this bucket "
            "reaches: another process truncated it",
        )


class ShmReceiver(Receiver):
    # The client writes into the segment only; the host buffer, which the update's jobs copy each bucket into, is the
    # worker's own (an aborted update's segment is unlinked, never reused).
    staging_reusable_after_abort = True

    def staging(self, pool: Any, nbytes: int) -> tuple[torch.Tensor, tuple[Any, torch.Tensor] | None]:
        host = pool.host(nbytes)
        try:
            shared = pool.shared(nbytes)
        except OSError as error:
            pool.give_back(host, None)  # written by no one yet: the next update may take it
            raise UpdateRejected("bad_update", "transport", f"cannot create a shared-memory segment: {error}") from None
        return host, shared

    def take_bytes(
        self, area: StagingArea, begin: WeightsBegin, pieces: list[TensorPiece], frames: list, checksum: int | None
    ) -> None:
        """The trainer wrote the pieces in place: copy them out of the segment into the worker's own memory, then
        check that copy against the checksum and count it. What was checked is what commits: bytes written into the
        segment after this copy change nothing (the segment's size is checked first: reading a truncated segment's
        pages would end the worker). The checksum is required here: a segment is reused from one update to the next,
        so without it a bucket whose bytes the client never wrote would commit the last update's bytes unnoticed."""
        if checksum is None:
            raise UpdateRejected(
                "bad_update",
                "checksum",
                "required over transport shm: the shared segment still holds the last update's bytes, so only a "
                "bucket's checksum shows that the client wrote this one's (push_weights always sends it)",
            )
        area.check_segment()
        area.verify(pieces, area.copy_from_segment(pieces), checksum)
        area.mark_received(pieces)


TRANSPORT = WeightTransport("shm", ShmSender, ShmReceiver)
