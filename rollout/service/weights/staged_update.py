"""A weight update on the worker, as a transaction: begin (announce names, dtypes, shapes) -> buckets of bytes ->
commit. Everything is staged in host memory first and checked (every name, dtype and shape against the model at
begin; every byte of every announced tensor at commit); only then does the engine copy it into the model, all at
once, between two steps. A rejected update leaves nothing behind and the old weights keep serving.

The wire contract both ends share (dtype names, staging layout, checksums) is in staging.py.
"""

from __future__ import annotations

import logging
import time
from multiprocessing import shared_memory
from typing import Any

import torch

from rollout import protocol as p
from rollout.config import MAX_POLICY_VERSION, WEIGHT_UPDATE_MODES, FieldError
from rollout.engine.engine import Engine
from rollout.protocol.dist import check_dist_fields
from rollout.protocol.staging import (
    DTYPES,
    StagingPool,
    bucket_checksum,
    release_segment,
    staging_layout,
    tensor_nbytes,
)
from rollout.service.weights.adapter_checks import BaseMismatch, check_adapter_fields
from rollout.service.weights.jobs import SerialJobs

logger = logging.getLogger(__name__)


class UpdateRejected(Exception):
    """A weight update that cannot go on; the worker answers with an Error carrying `code` and `field`."""

    def __init__(self, code: str, field: str | None, reason: str):
        super().__init__(f"{field}: {reason}" if field else reason)
        self.code = code
        self.field = field


def _payload(frame: Any) -> memoryview:
    """The bytes of a received frame (a zmq.Frame taken without a copy, or bytes)."""
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


class StagedUpdate:
    """One open weight update of one client: its announcement, staging area, progress and deadline."""

    def __init__(
        self,
        begin: p.WeightsBegin,
        engine: Engine,
        identity: bytes,
        pool: StagingPool,
        max_phase_s: float = 600.0,
        base_id: str | None = None,
    ):
        """Validate the announcement and take a staging area from the pool.

        Args:
            begin: the client's weights_begin.
            engine: the engine whose model the update targets (read-only here).
            identity: the client's ZeroMQ identity (only it may continue the update).
            pool: where staging areas come from and go back to.
            max_phase_s: the longest phase deadline (`timeout_s`) allowed.
            base_id: the base weights the worker serves (an adapter update must be for them).
        Raises:
            UpdateRejected: a bad field or tensor, named.
        """
        self.begin = begin
        self.identity = identity
        self.update_id = begin.update_id
        self.committing = False
        self.ended = False  # rejected, aborted or committed: queued jobs of the update skip their work
        self.closed = False  # its staging area went back (`close`)
        self._check_fields(begin, engine, max_phase_s)
        if begin.adapter is not None:
            try:
                check_adapter_fields(begin, engine, base_id)
            except FieldError as error:
                code = "base_mismatch" if isinstance(error, BaseMismatch) else "bad_update"
                raise UpdateRejected(code, error.field, error.reason) from None
        self.specs = begin.tensors
        self.sizes = [tensor_nbytes(spec) for spec in self.specs]
        self.offsets, self.staging_bytes = staging_layout(self.specs)
        self.num_buckets = 0
        self.announced = [0] * len(self.specs)  # bytes that bucket headers promised, per tensor
        self.received = [0] * len(self.specs)  # bytes that landed in the staging area, per tensor
        self.pool = pool
        self.shm: shared_memory.SharedMemory | None = None
        self._shared: tuple[shared_memory.SharedMemory, torch.Tensor] | None = None
        self._host: torch.Tensor | None = None
        if begin.transport == "shm":
            try:
                self._shared = pool.shared(self.staging_bytes)
            except OSError as error:
                raise UpdateRejected(
                    "bad_update", "transport", f"cannot create a shared-memory segment: {error}"
                ) from None
            self.shm = self._shared[0]
            self.staging = self._shared[1][: self.staging_bytes]
        else:
            self._host = pool.host(self.staging_bytes)
            self.staging = self._host[: self.staging_bytes]
        self.deadline = 0.0
        self.touch()
        # Work that grows with the update's size (hashing, staging, receiving, the commit's checks) runs here, in
        # order, off the serving thread; one thread per update, so a stuck broadcast holds up only its own update.
        self.jobs = SerialJobs(f"rollout-weights-{self.update_id[:32]}")

    @staticmethod
    def _check_fields(begin: p.WeightsBegin, engine: Engine, max_phase_s: float) -> None:
        if begin.mode not in WEIGHT_UPDATE_MODES:
            raise UpdateRejected("bad_update", "mode", f"must be one of {list(WEIGHT_UPDATE_MODES)}")
        if begin.transport not in p.WEIGHT_TRANSPORTS:
            raise UpdateRejected("bad_update", "transport", f"must be one of {list(p.WEIGHT_TRANSPORTS)}")
        if begin.transport == "torch.distributed":
            culprit = check_dist_fields(begin.dist)
            if culprit is not None:
                raise UpdateRejected("bad_update", culprit, "missing or wrong (host, port, world_size, rank, ...)")
        if not 0 < begin.timeout_s <= max_phase_s:
            raise UpdateRejected(
                "bad_update", "timeout_s", f"must be in (0, {max_phase_s:g}] seconds (the worker's limit)"
            )
        if begin.version is not None and not engine.policy_version < begin.version <= MAX_POLICY_VERSION:
            raise UpdateRejected(
                "bad_update",
                "version",
                f"must exceed the current version {engine.policy_version} and be at most {MAX_POLICY_VERSION} (int64), "
                f"got {begin.version}",
            )
        if begin.version is None and engine.policy_version >= MAX_POLICY_VERSION:
            raise UpdateRejected("bad_update", "version", f"the current version is already {MAX_POLICY_VERSION}")
        if not begin.tensors:
            raise UpdateRejected("bad_update", "tensors", "an update must announce at least one tensor")
        seen: set[str] = set()
        for index, spec in enumerate(begin.tensors):
            if spec.name in seen:
                raise UpdateRejected("bad_update", spec.name, "announced twice")
            seen.add(spec.name)
            if spec.dtype not in DTYPES:
                raise UpdateRejected("bad_update", spec.name, f"unknown dtype {spec.dtype!r}")
            if any(size < 0 for size in spec.shape):
                raise UpdateRejected("bad_update", f"tensors[{index}].shape", "sizes must be >= 0")
        if begin.adapter is not None:
            return  # the adapter's tensors are checked against the adapter table (check_adapter_fields)
        try:
            engine.weights.check_specs({s.name: (s.dtype, tuple(s.shape)) for s in begin.tensors}, begin.partial)
        except FieldError as error:
            raise UpdateRejected("bad_update", error.field, error.reason) from None

    def touch(self) -> None:
        """Restart the phase deadline (called on every message of the update)."""
        self.deadline = time.monotonic() + self.begin.timeout_s

    def expired(self, now: float) -> bool:
        """True when the client let a phase run past its deadline (a committing update waits on the engine)."""
        return not self.committing and now > self.deadline

    # ---- bytes in ---------------------------------------------------------------------------------------------
    def announce(self, pieces: list[p.TensorPiece]) -> None:
        """Check a bucket header's pieces and count them as promised. Pieces must name announced tensors and continue
        each exactly where its previous piece stopped (in order, no gap, no overlap, nothing past its end).

        Raises:
            UpdateRejected: naming the tensor.
        """
        expected = list(self.announced)
        for piece in pieces:
            if not 0 <= piece.index < len(self.specs):
                raise UpdateRejected("bad_update", "pieces.index", f"{piece.index} is not an announced tensor index")
            name = self.specs[piece.index].name
            if piece.offset != expected[piece.index]:
                raise UpdateRejected(
                    "bad_update", name, f"piece at byte {piece.offset}, expected byte {expected[piece.index]}"
                )
            if piece.nbytes < 0 or piece.offset + piece.nbytes > self.sizes[piece.index]:
                raise UpdateRejected(
                    "bad_update",
                    name,
                    f"piece [{piece.offset}, {piece.offset + piece.nbytes}) exceeds its "
                    f"{self.sizes[piece.index]} bytes",
                )
            expected[piece.index] += piece.nbytes
        self.announced = expected

    def check_frames(self, pieces: list[p.TensorPiece], frames: list) -> None:
        """Check a frames bucket's structure (one whole frame per piece, pieces in order) and count its pieces as
        promised; `stage_frames` then checks the bytes and stages them (off the serving thread).

        Raises:
            UpdateRejected: a missing or truncated frame, or a bad piece.
        """
        if len(frames) != len(pieces):
            raise UpdateRejected("bad_update", "pieces", f"{len(pieces)} pieces but {len(frames)} data frames")
        for piece, frame in zip(pieces, frames):
            nbytes = _payload(frame).nbytes
            if nbytes != piece.nbytes:
                name = self.specs[piece.index].name if 0 <= piece.index < len(self.specs) else f"piece {piece.index}"
                raise UpdateRejected(
                    "bad_update", name, f"truncated: frame has {nbytes} bytes, piece says {piece.nbytes}"
                )
        self.announce(pieces)

    def stage_frames(self, pieces: list[p.TensorPiece], frames: list, checksum: int | None = None) -> None:
        """Check a frames bucket's bytes against its checksum, then copy them into the staging area (transport
        "frames"; `check_frames` passed).

        Raises:
            UpdateRejected: bytes that do not match `checksum`; nothing of the bucket is staged then.
        """
        payloads = [_payload(frame) for frame in frames]
        self.verify(pieces, payloads, checksum)
        for piece, payload in zip(pieces, payloads):
            if piece.nbytes:
                self._stage(piece, torch.frombuffer(payload, dtype=torch.uint8))

    def staging_views(self, pieces: list[p.TensorPiece]) -> list[torch.Tensor]:
        """Where each piece's bytes go in the staging area (transport "torch.distributed" receives into them;
        `announce` was called when the bucket header came)."""
        views = []
        for piece in pieces:
            start = self.offsets[piece.index] + piece.offset
            views.append(self.staging[start : start + piece.nbytes])
        return views

    def staging_span(self, pieces: list[p.TensorPiece]) -> torch.Tensor:
        """The staging bytes from the first piece's start to the last piece's end, alignment gaps included: transport
        "torch.distributed" receives a whole bucket in one broadcast. Its pieces must follow one another: each but
        the last ends its tensor, and the next starts the next tensor (`announce` checked each piece).

        Raises:
            UpdateRejected: pieces that leave a tensor unfinished, skip one, or go back.
        """
        for before, after in zip(pieces, pieces[1:]):
            if (
                before.offset + before.nbytes != self.sizes[before.index]
                or after.index != before.index + 1
                or after.offset != 0
            ):
                raise UpdateRejected(
                    "bad_update",
                    "pieces",
                    "a torch.distributed bucket holds consecutive pieces (each but the last ends its tensor, the next "
                    f"starts the following tensor): piece of tensor {after.index} at byte {after.offset} follows "
                    f"tensor {before.index} up to byte {before.offset + before.nbytes}",
                )
        first, last = pieces[0], pieces[-1]
        start = self.offsets[first.index] + first.offset
        return self.staging[start : self.offsets[last.index] + last.offset + last.nbytes]

    def mark_received(self, pieces: list[p.TensorPiece]) -> None:
        """Count pieces whose bytes landed in the staging area."""
        for piece in pieces:
            self.received[piece.index] += piece.nbytes

    def check_written(self, pieces: list[p.TensorPiece], checksum: int | None = None) -> None:
        """Check the pieces the client wrote straight into the shared staging segment (transport "shm") against
        the bucket's checksum and count them (`announce` was called when the bucket header came).

        Raises:
            UpdateRejected: staged bytes that do not match `checksum`.
        """
        self.verify(pieces, self.staging_views(pieces), checksum)
        self.mark_received(pieces)

    def verify(self, pieces: list[p.TensorPiece], chunks: list, checksum: int | None) -> None:
        """Check a bucket's bytes against the checksum its header carried (None: the sender sent none).

        Raises:
            UpdateRejected: field "checksum", naming the bucket's tensors.
        """
        self.num_buckets += 1
        if checksum is None or bucket_checksum(chunks) == checksum:
            return
        names = sorted({self.specs[piece.index].name for piece in pieces})
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise UpdateRejected(
            "bad_update",
            "checksum",
            f"bucket {self.num_buckets} ({shown}) does not match its checksum: its bytes were corrupted on the way",
        )

    def _stage(self, piece: p.TensorPiece, data: torch.Tensor) -> None:
        start = self.offsets[piece.index] + piece.offset
        self.staging[start : start + piece.nbytes].copy_(data)
        self.received[piece.index] += piece.nbytes

    @property
    def received_bytes(self) -> int:
        """Bytes staged so far."""
        return sum(self.received)

    # ---- commit -----------------------------------------------------------------------------------------------
    def tensors(self, check_finite: bool = False) -> dict[str, torch.Tensor]:
        """Every announced tensor as a view of the staging area, once all arrived whole.

        Args:
            check_finite: also refuse a floating tensor holding NaN or Inf (a diverged update).
        Raises:
            UpdateRejected: naming the first tensor that did not arrive whole, or is not finite.
        """
        for spec, size, got in zip(self.specs, self.sizes, self.received):
            if got != size:
                raise UpdateRejected("bad_update", spec.name, f"incomplete: {got} of {size} bytes arrived")
        tensors = {
            spec.name: self.staging[offset : offset + size].view(DTYPES[spec.dtype]).view(spec.shape)
            for spec, offset, size in zip(self.specs, self.offsets, self.sizes)
        }
        if check_finite:
            for name, tensor in tensors.items():
                if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
                    raise UpdateRejected(
                        "bad_update", name, "holds NaN or Inf values (the worker checks: --check-finite)"
                    )
        return tensors

    def end(self, clean: bool) -> None:
        """The update is over (committed, rejected or aborted): its queued jobs skip their work, and its staging
        area goes back once the job running now, if any, is done with it (`close`, on the job thread).

        Args:
            clean: it was committed.
        """
        self.ended = True
        self.jobs.submit(lambda: self.close(clean))
        self.jobs.close()

    def close(self, clean: bool = True) -> None:
        """Give the staging area back to the pool (idempotent). No job of the update may run meanwhile (`end`).

        Args:
            clean: the update was committed. Otherwise only a frames update's host buffer goes back (only its
                jobs wrote it); a shared segment (its client may not know yet) and a dist update's buffer (a
                broadcast of an abandoned group may still be writing) are dropped.
        """
        if self.closed:
            return
        self.closed = self.ended = True
        self.staging = torch.empty(0, dtype=torch.uint8)
        if clean or self.begin.transport == "frames":
            self.pool.give_back(self._host, self._shared if clean else None)
        if not clean and self._shared is not None:
            release_segment(*self._shared)
        self._host = self._shared = None
