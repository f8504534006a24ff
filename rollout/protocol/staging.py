"""The weight wire contract that trainer and worker share, and where an update's bytes land before commit.

Staging layout: the announced tensors one after the other, each at an offset aligned to `ALIGN` bytes, so a slice
of the staging area viewed as the tensor's dtype is a valid tensor; both ends compute it with `staging_layout`. A
bucket's checksum is `bucket_checksum` of its pieces' bytes. The area is a host buffer of the worker's own (pinned on
GPU hosts); transport "shm" adds a shared-memory segment the trainer writes into, which the worker copies each bucket
out of before checking it (so what it checked is what commits). Both are kept from one update to the next
(`StagingPool`). This module imports neither the engine nor transformers: `trainer_bridge` uses it."""

from __future__ import annotations

import os
import re
import threading
import uuid
from collections.abc import Iterable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch
import xxhash

from rollout import protocol as p

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

# A staging segment's name: the worker's prefix and 16 hex digits (what a trainer agrees to open and write into).
SEGMENT_PREFIX = "rollout-"
SEGMENT_NAME = re.compile(re.escape(SEGMENT_PREFIX) + "[0-9a-f]{16}")
_CREATED_HERE: set[str] = set()  # the staging segments this process created and has not unlinked yet


def tensor_nbytes(spec: p.TensorSpec) -> int:
    """Bytes of an announced tensor."""
    numel = 1
    for size in spec.shape:
        numel *= size
    return numel * DTYPES[spec.dtype].itemsize


def bucket_checksum(chunks: Iterable[Any]) -> int:
    """The checksum of a bucket: xxh3_64 (xxhash) of its pieces' bytes, in order. Chunks are uint8 CPU tensors or
    buffers. The trainer sends it with the bucket; the worker recomputes it over what it staged."""
    digest = xxhash.xxh3_64()
    for chunk in chunks:
        digest.update(memoryview(chunk.numpy()) if isinstance(chunk, torch.Tensor) else chunk)
    return digest.intdigest()


def staging_layout(specs: list[p.TensorSpec]) -> tuple[list[int], int]:
    """(offset of each tensor, total bytes) in the staging area: in order, each aligned to ALIGN bytes."""
    offsets, end = [], 0
    for spec in specs:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + tensor_nbytes(spec)
    return offsets, end


def bucket_span(bucket: list[tuple[int, int, torch.Tensor]], offsets: list[int]) -> torch.Tensor:
    """A bucket's bytes laid out as in the workers' staging area, from its first piece to its last (alignment gaps
    zeroed): what one broadcast sends (the torch.distributed receiver, `bucket_staging_span`, receives it)."""
    if len(bucket) == 1:
        return bucket[0][2]
    starts = [offsets[index] + offset for index, offset, _ in bucket]
    span = torch.zeros(starts[-1] + bucket[-1][2].numel() - starts[0], dtype=torch.uint8, device=bucket[0][2].device)
    for start, (_, _, data) in zip(starts, bucket):
        span[start - starts[0] : start - starts[0] + data.numel()].copy_(data)
    return span


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN or Inf (what --check-finite checks). torch checks no float8 dtype but
    e5m2 ("isfinite" is not implemented for float8_e4m3fn): those are widened first, one chunk at a time (every
    float8 value is exact in float16, NaN stays NaN)."""
    try:
        return bool(torch.isfinite(tensor).all())
    except (NotImplementedError, RuntimeError):
        if tensor.element_size() != 1:
            raise
    flat = tensor.reshape(-1)
    step = 1 << 24
    return all(bool(torch.isfinite(flat[i : i + step].to(torch.float16)).all()) for i in range(0, flat.numel(), step))


def attach_shared_memory(name: str) -> shared_memory.SharedMemory:
    """Open a worker's staging segment from another process without taking ownership of it (the worker unlinks
    it; Python < 3.13 would otherwise unlink it when this process exits).

    Raises:
        OSError: `name` is not a staging segment's (a worker's reply names only those: the trainer writes into what
            it opens, so it opens nothing else of its user's shared memory).
    """
    if not isinstance(name, str) or not SEGMENT_NAME.fullmatch(name):
        raise OSError(f"{name!r} is not a rollout staging segment's name")
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        segment = shared_memory.SharedMemory(name=name)
        # The documented workaround; but a segment this very process created (a worker and its trainer in one
        # process) keeps its one registration, its creator's: removing it made the creator's unlink a KeyError in
        # the resource tracker.
        if name not in _CREATED_HERE:
            resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001
        return segment


class StagingPool:
    """Staging areas kept from one update to the next: allocating and faulting in an update-sized buffer (pinned,
    on GPU hosts) costs more than moving the bytes. With `keep=False` each update's area is freed when it ends."""

    def __init__(self, keep: bool = True, pin_device: torch.device | None = None):
        """
        Args:
            keep: keep the last host buffer and shared segment for the next update.
            pin_device: the GPU the model is on: host buffers are page-locked for its copies (faster, non-blocking);
                None: not locked. Shared segments never are: the worker copies their bytes into its host buffer.
        """
        self.keep = keep
        self.pin_device = pin_device
        self._lock = threading.Lock()  # areas are taken on the serving thread and come back on an update's job thread
        self._closed = False  # areas given back after `close` are freed
        self._host: torch.Tensor | None = None
        self._shm: tuple[shared_memory.SharedMemory, torch.Tensor] | None = None

    def host(self, nbytes: int) -> torch.Tensor:
        """A host buffer of at least `nbytes` (the kept one when it is large enough)."""
        with self._lock:
            buffer, self._host = self._host, None
        if buffer is None or buffer.numel() < nbytes:
            buffer = None  # free the small one first
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_device is not None)
        return buffer

    def shared(self, nbytes: int) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
        """A shared-memory segment of at least `nbytes` and a uint8 view of it (the kept one when large enough).

        Raises:
            OSError: the segment cannot be created (e.g. /dev/shm is too small).
        """
        with self._lock:
            kept, self._shm = self._shm, None
        if kept is not None and _intact(kept[0], nbytes):
            return kept
        if kept is not None:
            release_segment(*kept)
        segment = shared_memory.SharedMemory(
            name=f"{SEGMENT_PREFIX}{uuid.uuid4().hex[:16]}", create=True, size=max(nbytes, 1)
        )
        _CREATED_HERE.add(segment.name)
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
        with self._lock:
            if host is not None and self.keep and not self._closed:
                self._host = host
            if shm is not None and self.keep and self._shm is None and not self._closed:
                self._shm, shm = shm, None
        if shm is not None:
            release_segment(*shm)

    def close(self) -> None:
        """Free what is kept (unlinks the shared segment)."""
        with self._lock:
            kept, self._host, self._shm = self._shm, None, None
            self._closed = True
        if kept is not None:
            release_segment(*kept)


def _intact(segment: shared_memory.SharedMemory, nbytes: int) -> bool:
    """Whether a kept segment can serve an update of `nbytes`: still named in /dev/shm (a trainer attaches by name)
    and not shrunk by another process (reading its pages would end the worker)."""
    try:
        found = os.fstat(segment._fd)  # noqa: SLF001 - SharedMemory keeps its descriptor open on POSIX
    except (AttributeError, OSError):
        return False
    return found.st_nlink > 0 and min(found.st_size, segment.size) >= nbytes


def release_segment(segment: shared_memory.SharedMemory, view: torch.Tensor) -> None:
    """Unlink a segment at once; its memory goes when the last view of it does."""
    del view
    try:
        segment.unlink()
    except FileNotFoundError:
        pass
    _CREATED_HERE.discard(segment.name)
    try:
        segment.close()
    except BufferError:  # a tensor view still exists somewhere; the mapping is freed with it
        pass
