"""A weight update on the worker, as a transaction: begin (announce names, dtypes, shapes) -> buckets of bytes ->
commit. Everything is staged in the worker's own host memory first and checked (every name, dtype and shape against
the model at begin; every byte of every announced tensor at commit); only then does the engine copy it into the
model, all at once, between two steps. A rejected update leaves nothing behind and the old weights keep serving.

The wire contract both ends share (dtype names, staging layout, checksums) is in staging.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import torch

from rollout import protocol as p
from rollout.config import MAX_POLICY_VERSION, WEIGHT_UPDATE_MODES, FieldError
from rollout.engine.engine import Engine
from rollout.protocol.staging import (
    DTYPES,
    StagingPool,
    all_finite,
    bucket_checksum,
    release_segment,
    staging_layout,
    tensor_nbytes,
)
from rollout.protocol.transports import TRANSPORTS
from rollout.protocol.transports.base import Receiver, UpdateRejected
from rollout.service.weights.adapter_checks import BaseMismatch, brings_base, check_adapter_fields
from rollout.service.weights.jobs import SerialJobs

logger = logging.getLogger(__name__)


class StagedUpdate:
    """One open weight update of one client: its announcement, staging area, progress and deadline."""

    def __init__(
        self,
        begin: p.WeightsBegin,
        engine: Engine,
        identity: bytes,
        pool: StagingPool,
        receivers: Callable[[str], Receiver],
        peer: str | None = None,
        max_phase_s: float = 600.0,
        base_id: str | None = None,
        key: str | None = None,
        base_names: frozenset[str | None] = frozenset(),
    ):
        """Validate the announcement (its staging area is taken later: `take_staging`).

        Args:
            begin: the client's weights_begin.
            engine: the engine whose model the update targets (read-only here).
            identity: the client's ZeroMQ identity (only it may continue the update).
            pool: where staging areas come from and go back to.
            receivers: the worker's receiver of each transport, by name (`rollout.protocol.transports`).
            peer: the address the weights_begin came from (None: ipc or inproc, this machine).
            max_phase_s: the longest phase deadline (`timeout_s`) allowed.
            base_id: the base weights the worker serves (an adapter update must be for them).
            key: the client's CurveZMQ key (None: keys off): replies sent later go to `identity` only while it holds it.
            base_names: other names of the base the worker serves (`ServedBase.names`).
        Raises:
            UpdateRejected: a bad field or tensor, named.
        """
        self.begin = begin
        self.identity = identity
        self.key = key
        self.update_id = begin.update_id
        self.committing = False
        self.ended = False  # rejected, aborted or committed: queued jobs of the update skip their work
        self.closed = False  # its staging area went back (`close`)
        self.base_unchanged = False  # committed: the base it brought was the one served, bit for bit (engine thread)
        # An adapter update that brings base weights beside its own tensors (a whole update is all base).
        self.brings_base = begin.adapter is None or brings_base(begin)
        self.receiver = self._check_fields(begin, engine, max_phase_s, receivers, peer)
        if begin.adapter is not None:
            try:
                check_adapter_fields(begin, engine, base_id, base_names)
            except FieldError as error:
                code = "base_mismatch" if isinstance(error, BaseMismatch) else "bad_update"
                raise UpdateRejected(code, error.field, error.reason) from None
        self.specs = begin.tensors
        self.sizes = [tensor_nbytes(spec) for spec in self.specs]
        self.offsets, self.staging_bytes = staging_layout(self.specs)
        self.num_buckets = 0
        self.unacked = 0  # buckets taken whose weights_ack is not sent yet (the serving thread's count)
        self.announced = [0] * len(self.specs)  # bytes that bucket headers promised, per tensor
        self.named_empty: set[int] = set()  # zero-size tensors a bucket header named (each once: it carries no bytes)
        self.received = [0] * len(self.specs)  # bytes that landed in the staging area, per tensor
        self.pool = pool
        # The staging area comes in `take_staging`, the update's first job (never on the serving thread).
        self._host: torch.Tensor | None = None
        self._shared: tuple[shared_memory.SharedMemory, torch.Tensor] | None = None
        self.shm: shared_memory.SharedMemory | None = None
        self.staging = torch.empty(0, dtype=torch.uint8)  # the worker's own bytes: what is checked and committed
        self.segment = torch.empty(0, dtype=torch.uint8)  # transport "shm": where the client writes (`shm`)
        self.prepared = False  # its staging area exists: jobs may use it, and its phase deadline runs
        self.deadline = 0.0
        self.touch()
        # Work that grows with the update's size (hashing, staging, receiving, the commit's checks) runs here, in
        # order, off the serving thread; one thread per update, so a stuck broadcast holds up only its own update.
        self.jobs = SerialJobs(f"rollout-weights-{self.update_id[:32]}")

    @staticmethod
    def _check_fields(
        begin: p.WeightsBegin,
        engine: Engine,
        max_phase_s: float,
        receivers: Callable[[str], Receiver],
        peer: str | None,
    ) -> Receiver:
        """Check the announcement's fields, the transport's own right after its name; returns its receiver."""
        if begin.mode not in WEIGHT_UPDATE_MODES:
            raise UpdateRejected("bad_update", "mode", f"must be one of {list(WEIGHT_UPDATE_MODES)}")
        if begin.transport not in TRANSPORTS:
            raise UpdateRejected("bad_update", "transport", f"must be one of {list(TRANSPORTS)}")
        if begin.dist and begin.transport != "torch.distributed":
            raise UpdateRejected("bad_update", "dist", f"has no effect with transport {begin.transport!r}")
        if begin.scalings and begin.adapter is None:
            raise UpdateRejected("bad_update", "scalings", "has no effect without adapter (a LoRA adapter's scalings)")
        receiver = receivers(begin.transport)
        receiver.check_begin(begin, peer)
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
        for spec in begin.tensors:
            if spec.name in seen:
                raise UpdateRejected("bad_update", spec.name, "announced twice")
            seen.add(spec.name)
            if spec.dtype not in DTYPES:
                raise UpdateRejected("bad_update", spec.name, f"unknown dtype {spec.dtype!r}")
            if any(size < 0 for size in spec.shape):
                raise UpdateRejected("bad_update", spec.name, f"shape {spec.shape}: sizes must be >= 0")
        if begin.adapter is not None:
            return receiver  # the adapter's tensors are checked against the adapter table (check_adapter_fields)
        try:
            engine.weight_table.check_specs({s.name: (s.dtype, tuple(s.shape)) for s in begin.tensors}, begin.partial)
        except FieldError as error:
            raise UpdateRejected("bad_update", error.field, error.reason) from None
        return receiver

    def touch(self) -> None:
        """Restart the phase deadline (called on every message of the update)."""
        self.deadline = time.monotonic() + self.begin.timeout_s

    def expired(self, now: float) -> bool:
        """True when the client let a phase run past its deadline (a committing update waits on the engine; one
        still without its staging area waits on the worker)."""
        return self.prepared and not self.committing and now > self.deadline

    def take_staging(self) -> None:
        """Take the update's staging area from the pool, on its job thread (the first job, so every bucket's job
        finds it): making an update-sized area can take seconds (reserving a shared segment's pages takes about
        150 ms per GB, page-locking it for a GPU more), which the serving thread must not spend.

        Raises:
            UpdateRejected: none can be made (e.g. /dev/shm too small for a shared segment), naming the transport.
        """
        host, shared = self.receiver.staging(self.pool, self.staging_bytes)
        self._host, self._shared = host, shared
        self.staging = host[: self.staging_bytes]
        if shared is not None:
            self.shm, self.segment = shared[0], shared[1][: self.staging_bytes]
        self.touch()  # the worker's own time making it is not the client's
        self.prepared = True

    # ---- bytes in ---------------------------------------------------------------------------------------------
    def announce(self, pieces: list[p.TensorPiece]) -> None:
        """Check a bucket header's pieces and count them as promised. Pieces must name announced tensors and continue
        each exactly where its previous piece stopped (in order, no gap, no overlap, nothing past its end). A bucket
        must move the update on (bytes, or a zero-size tensor named for the first time): every message of the update
        renews its phase deadline, so buckets that add nothing would hold the update slot forever.

        Raises:
            UpdateRejected: naming the tensor, or "pieces" for a bucket that adds nothing.
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
        empty = {piece.index for piece in pieces if self.sizes[piece.index] == 0}
        if expected == self.announced and empty <= self.named_empty:
            raise UpdateRejected("bad_update", "pieces", "the bucket adds no bytes (and names no new zero-size tensor)")
        self.announced = expected
        self.named_empty |= empty

    def staging_views(self, pieces: list[p.TensorPiece]) -> list[torch.Tensor]:
        """Where each piece's bytes go in the staging area (transport "torch.distributed" receives into them;
        `announce` was called when the bucket header came)."""
        views = []
        for piece in pieces:
            start = self.offsets[piece.index] + piece.offset
            views.append(self.staging[start : start + piece.nbytes])
        return views

    def check_segment(self) -> None:
        """Refuse the update when its shared segment (transport "shm") no longer holds the staging layout: a segment
        truncated by another process would end the worker with SIGBUS at the next read of its pages. Called before
        each bucket is copied out of it. A process that truncates it in the instant between this check and the copy
        is beyond it: over "shm" the worker trusts the processes of its user on its host.

        Raises:
            UpdateRejected: field "transport", naming the segment's size.
        """
        if self.shm is None:
            return
        size = os.fstat(self.shm._fd).st_size  # noqa: SLF001 - SharedMemory keeps its descriptor open on POSIX
        if size < self.staging_bytes:
            raise UpdateRejected(
                "bad_update",
                "transport",
                f"the shared-memory segment {self.shm.name} shrank to {size} bytes, under the update's "
                f"{self.staging_bytes}: another process truncated it",
            )

    def copy_from_segment(self, pieces: list[p.TensorPiece]) -> list[torch.Tensor]:
        """Copy the pieces' bytes from the shared segment (transport "shm") into their places in the staging area;
        returns those places (the copy is what the checksum is checked on, and what commits)."""
        views = self.staging_views(pieces)
        for piece, view in zip(pieces, views):
            start = self.offsets[piece.index] + piece.offset
            view.copy_(self.segment[start : start + piece.nbytes])
        return views

    def mark_received(self, pieces: list[p.TensorPiece]) -> None:
        """Count pieces whose bytes landed in the staging area."""
        for piece in pieces:
            self.received[piece.index] += piece.nbytes

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

    def stage(self, piece: p.TensorPiece, data: torch.Tensor) -> None:
        """Copy one piece's bytes into its place and count them."""
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
                if tensor.is_floating_point() and tensor.numel() and not all_finite(tensor):
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
            clean: the update was committed. Otherwise the staging goes back only where its transport says no one
                else may still write into it (`Receiver.staging_reusable_after_abort`: a frames update's host
                buffer; not a shared segment, whose client may not know yet, nor a buffer an abandoned broadcast
                may still be writing).
        """
        if self.closed:
            return
        self.closed = self.ended = True
        self.staging = self.segment = torch.empty(0, dtype=torch.uint8)
        if clean or self.receiver.staging_reusable_after_abort:
            self.pool.give_back(self._host, self._shared if clean else None)
        if not clean and self._shared is not None:
            release_segment(*self._shared)
        self._host = self._shared = None
