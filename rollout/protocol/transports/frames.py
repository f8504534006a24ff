"""Transport "frames": each bucket's bytes as raw ZeroMQ frames after its header, one frame per piece. Works across
hosts; the worker copies each frame into its staging area on the update's job thread."""

from __future__ import annotations

from typing import Any

import torch

from rollout.protocol.transports.base import Receiver, Sender, StagingArea, UpdateRejected, WeightTransport
from rollout.protocol.weight_messages import TensorPiece, WeightsBegin, WeightsBucket


def _payload(frame: Any) -> memoryview:
    """The bytes of a received frame (a zmq.Frame taken without a copy, or bytes)."""
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


class FramesSender(Sender):
    def send_bucket(
        self, link: Any, header: WeightsBucket, bucket: list[tuple[int, int, torch.Tensor]], offsets: list[int]
    ) -> Any:
        host = [data.cpu() for _, _, data in bucket]
        self.push.channel.send(link.index, header, [memoryview(data.numpy()) for data in host])
        return host  # ZeroMQ sends without copying: the bytes stay alive until the worker acknowledges them


class FramesReceiver(Receiver):
    staging_reusable_after_abort = True  # only the update's own jobs copy frames into its staging

    def accept_bucket(self, area: StagingArea, pieces: list[TensorPiece], frames: list) -> None:
        """One whole frame per piece, pieces in order; the bytes are checked and staged by `take_bytes`."""
        if len(frames) != len(pieces):
            raise UpdateRejected("bad_update", "pieces", f"{len(pieces)} pieces but {len(frames)} data frames")
        for piece, frame in zip(pieces, frames):
            nbytes = _payload(frame).nbytes
            if nbytes != piece.nbytes:
                name = area.specs[piece.index].name if 0 <= piece.index < len(area.specs) else f"piece {piece.index}"
                raise UpdateRejected(
                    "bad_update", name, f"truncated: frame has {nbytes} bytes, piece says {piece.nbytes}"
                )
        area.announce(pieces)

    def take_bytes(
        self, area: StagingArea, begin: WeightsBegin, pieces: list[TensorPiece], frames: list, checksum: int | None
    ) -> None:
        """Check the frames against the checksum, then copy them into place: nothing is staged from a bad bucket."""
        payloads = [_payload(frame) for frame in frames]
        area.verify(pieces, payloads, checksum)
        for piece, payload in zip(pieces, payloads):
            if piece.nbytes:
                area.stage(piece, torch.frombuffer(payload, dtype=torch.uint8))


TRANSPORT = WeightTransport("frames", FramesSender, FramesReceiver)
