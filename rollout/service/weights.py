"""A weight update on the worker, as a transaction: begin (announce names, dtypes, shapes) -> buckets of bytes ->
commit. Everything is staged in host memory first and checked (every name, dtype and shape against the model at
begin; every byte of every announced tensor at commit); only then does the engine copy it into the model, all at
once, between two steps. A rejected update leaves nothing behind and the old weights keep serving.

Staging layout: the announced tensors one after the other, each at an offset aligned to `ALIGN` bytes, so a slice
of the staging area viewed as the tensor's dtype is a valid tensor. Both ends compute it with `staging_layout`.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from multiprocessing import resource_tracker, shared_memory

import torch

from rollout.config import FieldError
from rollout.engine.engine import MAX_POLICY_VERSION, WEIGHT_UPDATE_MODES, Engine
from rollout.service import protocol as p
from rollout.service.dist import check_dist_fields

logger = logging.getLogger(__name__)

TRANSPORTS = ("frames", "shm", "torch.distributed")
ALIGN = 64
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "bfloat16",
        "float16",
        "float8_e4m3fn",
        "float8_e5m2",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
    if hasattr(torch, name)
}


class UpdateRejected(Exception):
    """A weight update that cannot go on; the worker answers with an Error carrying `code` and `field`."""

    def __init__(self, code: str, field: str | None, reason: str):
        super().__init__(f"{field}: {reason}" if field else reason)
        self.code = code
        self.field = field


def tensor_nbytes(spec: p.TensorSpec) -> int:
    """Bytes of an announced tensor."""
    numel = 1
    for size in spec.shape:
        numel *= size
    return numel * DTYPES[spec.dtype].itemsize


def staging_layout(specs: list[p.TensorSpec]) -> tuple[list[int], int]:
    """(offset of each tensor, total bytes) in the staging area: in order, each aligned to ALIGN bytes."""
    offsets, end = [], 0
    for spec in specs:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + tensor_nbytes(spec)
    return offsets, end


def attach_shared_memory(name: str) -> shared_memory.SharedMemory:
    """Open a worker's staging segment from another process without taking ownership of it (the worker unlinks
    it; Python < 3.13 would otherwise unlink it when this process exits)."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        segment = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001 - the documented workaround
        return segment


class StagingPool:
    """Staging areas kept from one update to the next: allocating and faulting in an update-sized buffer (pinned,
    on GPU hosts) costs more than moving the bytes. With `keep=False` each update's area is freed when it ends."""

    def __init__(self, keep: bool = True, pin: bool = False):
        """
        Args:
            keep: keep the last host buffer and shared segment for the next update.
            pin: allocate page-locked host memory (the model is on a GPU: faster, non-blocking copies).
        """
        self.keep = keep
        self.pin = pin
        self._host: torch.Tensor | None = None
        self._shm: tuple[shared_memory.SharedMemory, torch.Tensor] | None = None

    def host(self, nbytes: int) -> torch.Tensor:
        """A host buffer of at least `nbytes` (the kept one when it is large enough)."""
        buffer, self._host = self._host, None
        if buffer is None or buffer.numel() < nbytes:
            buffer = None  # free the small one first
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return buffer

    def shared(self, nbytes: int) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
        """A shared-memory segment of at least `nbytes` and a uint8 view of it (the kept one when large enough).

        Raises:
            OSError: the segment cannot be created (e.g. /dev/shm is too small).
        """
        kept, self._shm = self._shm, None
        if kept is not None and kept[0].size >= nbytes:
            return kept
        if kept is not None:
            _release_segment(*kept)
        segment = shared_memory.SharedMemory(name=f"rollout-{uuid.uuid4().hex[:16]}", create=True, size=max(nbytes, 1))
        try:
            # tmpfs segments are sparse: reserve the pages now, so a too-small /dev/shm (64 MB in a default Docker
            # container) fails here, and the client falls back to frames, instead of a SIGBUS on first write.
            if hasattr(os, "posix_fallocate") and getattr(segment, "_fd", -1) >= 0:
                os.posix_fallocate(segment._fd, 0, max(nbytes, 1))  # noqa: SLF001
        except OSError:
            segment.close()
            segment.unlink()
            raise
        return segment, torch.frombuffer(segment.buf, dtype=torch.uint8)

    def give_back(self, host: torch.Tensor | None, shm: tuple[shared_memory.SharedMemory, torch.Tensor] | None) -> None:
        """Keep an update's area for the next one (or free it when not keeping)."""
        if host is not None and self.keep:
            self._host = host
        if shm is not None:
            if self.keep and self._shm is None:
                self._shm = shm
            else:
                _release_segment(*shm)

    def close(self) -> None:
        """Free what is kept (unlinks the shared segment)."""
        self._host = None
        if self._shm is not None:
            _release_segment(*self._shm)
            self._shm = None


def _release_segment(segment: shared_memory.SharedMemory, view: torch.Tensor) -> None:
    """Unlink a segment at once; its memory goes when the last view of it does."""
    del view
    try:
        segment.unlink()
    except FileNotFoundError:
        pass
    try:
        segment.close()
    except BufferError:  # a tensor view still exists somewhere; the mapping is freed with it
        pass


class StagedUpdate:
    """One open weight update of one client: its announcement, staging area, progress and deadline."""

    def __init__(
        self, begin: p.WeightsBegin, engine: Engine, identity: bytes, pool: StagingPool, max_phase_s: float = 600.0
    ):
        """Validate the announcement and take a staging area from the pool.

        Args:
            begin: the client's weights_begin.
            engine: the engine whose model the update targets (read-only here).
            identity: the client's ZeroMQ identity (only it may continue the update).
            pool: where staging areas come from and go back to.
            max_phase_s: the longest phase deadline (`timeout_s`) allowed.
        Raises:
            UpdateRejected: a bad field or tensor, named.
        """
        self.begin = begin
        self.identity = identity
        self.update_id = begin.update_id
        self.committing = False
        self.closed = False
        self._check_fields(begin, engine, max_phase_s)
        self.specs = begin.tensors
        self.sizes = [tensor_nbytes(spec) for spec in self.specs]
        self.offsets, self.staging_bytes = staging_layout(self.specs)
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

    @staticmethod
    def _check_fields(begin: p.WeightsBegin, engine: Engine, max_phase_s: float) -> None:
        if begin.mode not in WEIGHT_UPDATE_MODES:
            raise UpdateRejected("bad_update", "mode", f"must be one of {list(WEIGHT_UPDATE_MODES)}")
        if begin.transport not in TRANSPORTS:
            raise UpdateRejected("bad_update", "transport", f"must be one of {list(TRANSPORTS)}")
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
        try:
            engine.check_weight_specs({s.name: (s.dtype, tuple(s.shape)) for s in begin.tensors}, begin.partial)
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

    def accept_frames(self, pieces: list[p.TensorPiece], frames: list) -> None:
        """Copy one frame per piece into the staging area (transport "frames").

        Raises:
            UpdateRejected: a missing or truncated frame, or a bad piece; nothing of the bucket is counted then.
        """
        if len(frames) != len(pieces):
            raise UpdateRejected("bad_update", "pieces", f"{len(pieces)} pieces but {len(frames)} data frames")
        self.announce(pieces)
        for piece, frame in zip(pieces, frames):
            payload = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
            if payload.nbytes != piece.nbytes:
                name = self.specs[piece.index].name
                raise UpdateRejected(
                    "bad_update", name, f"truncated: frame has {payload.nbytes} bytes, piece says {piece.nbytes}"
                )
        for piece, frame in zip(pieces, frames):
            payload = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
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

    def mark_received(self, pieces: list[p.TensorPiece]) -> None:
        """Count pieces whose bytes landed in the staging area."""
        for piece in pieces:
            self.received[piece.index] += piece.nbytes

    def accept_written(self, pieces: list[p.TensorPiece]) -> None:
        """Count pieces the client wrote straight into the shared staging segment (transport "shm")."""
        self.announce(pieces)
        self.mark_received(pieces)

    def _stage(self, piece: p.TensorPiece, data: torch.Tensor) -> None:
        start = self.offsets[piece.index] + piece.offset
        self.staging[start : start + piece.nbytes].copy_(data)
        self.received[piece.index] += piece.nbytes

    @property
    def received_bytes(self) -> int:
        """Bytes staged so far."""
        return sum(self.received)

    # ---- commit -----------------------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every announced tensor as a view of the staging area, once all arrived whole.

        Raises:
            UpdateRejected: naming the first tensor that did not arrive whole.
        """
        for spec, size, got in zip(self.specs, self.sizes, self.received):
            if got != size:
                raise UpdateRejected("bad_update", spec.name, f"incomplete: {got} of {size} bytes arrived")
        return {
            spec.name: self.staging[offset : offset + size].view(DTYPES[spec.dtype]).view(spec.shape)
            for spec, offset, size in zip(self.specs, self.offsets, self.sizes)
        }

    def close(self, clean: bool = True) -> None:
        """Give the staging area back to the pool (idempotent).

        Args:
            clean: the update was committed. Otherwise only a frames update's host buffer goes back (the serving
                thread is its only writer); a shared segment (its client may not know yet) and a dist update's
                buffer (a broadcast may still be writing) are dropped.
        """
        if self.closed:
            return
        self.closed = True
        self.staging = torch.empty(0, dtype=torch.uint8)
        if clean or self.begin.transport == "frames":
            self.pool.give_back(self._host, self._shared if clean else None)
        if not clean and self._shared is not None:
            _release_segment(*self._shared)
        self._host = self._shared = None
