"""The torch.distributed weight transport: a process group of its own between one trainer process (rank 0) and
the workers (ranks 1..W), so bucket bytes go by broadcast (NCCL between GPUs, gloo on CPU) while begin, commit and
their deadlines stay on the ZeroMQ control plane.

The group never touches torch.distributed's default group: the trainer may already use that one for its own data
parallelism. It rendezvouses through a TCPStore that the trainer hosts.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
_DIST_FIELDS = {"host": str, "port": int, "world_size": int, "rank": int, "backend": str, "group": str}


def check_dist_fields(fields: dict[str, Any]) -> str | None:
    """The name of the first missing or mistyped rendezvous field of a weights_begin's `dist`, or None."""
    for name, kind in _DIST_FIELDS.items():
        if type(fields.get(name)) is not kind:
            return f"dist.{name}"
    if fields["backend"] not in BACKENDS:
        return "dist.backend"
    if not 0 < fields["rank"] < fields["world_size"]:
        return "dist.rank"
    return None


def make_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store; the trainer hosts it (`is_master`, port 0 picks a free port: read `store.port`)."""
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def make_process_group(store: dist.Store, group: str, rank: int, world_size: int, backend: str, timeout_s: float):
    """Join a process group of `world_size` ranks (blocks until every rank joined, or raises at the timeout).

    Args:
        store: the rendezvous store (`make_store`).
        group: a key unique to this group, so successive groups on one store do not mix.
        rank: this process's rank (the trainer is 0).
        world_size: trainer + workers.
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        timeout_s: deadline of the rendezvous and of every later broadcast.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(group, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Broadcast `tensor` from rank 0 (the trainer) to every rank of `group`, in place, and wait."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class DistReceiver:
    """The worker's side: one thread that joins groups and receives broadcast buckets, so the serving thread
    keeps answering while bytes arrive. Work items run in order; each reports through its own callback."""

    def __init__(self):
        self._group: Any = None
        self._group_key: str | None = None
        self._store: dist.TCPStore | None = None
        self._buffer: torch.Tensor | None = None  # receive buffer, reused while large enough
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rollout-weights-dist", daemon=True)
        self._thread.start()

    def join(self, fields: dict[str, Any], timeout_s: float, done: Callable[[BaseException | None], None]) -> None:
        """Join the group `fields` describes (reusing it when its key is the current one); then call `done`."""

        def job() -> None:
            try:
                if self._group_key != fields["group"]:
                    self._group = self._group_key = None
                    self._store = make_store(fields["host"], fields["port"], fields["world_size"], False, timeout_s)
                    self._group = make_process_group(
                        self._store, fields["group"], fields["rank"], fields["world_size"], fields["backend"], timeout_s
                    )
                    self._group_key = fields["group"]
            except Exception as error:  # noqa: BLE001 - reported to the update, which is rejected
                done(error)
            else:
                done(None)

        self._jobs.put(job)

    def receive(
        self, targets: list[torch.Tensor], device: torch.device, done: Callable[[BaseException | None], None]
    ) -> None:
        """Receive one broadcast per target, in order, into the targets (through a reused buffer on `device` when
        a target lives elsewhere, e.g. NCCL into CPU staging); then call `done` (None, or the error)."""

        def job() -> None:
            try:
                if self._group is None:
                    raise RuntimeError("no torch.distributed group joined")
                for target in targets:
                    if target.device == device:
                        broadcast(self._group, target)
                        continue
                    buffer = self._buffer
                    if buffer is None or buffer.device != device or buffer.numel() < target.numel():
                        buffer = self._buffer = torch.empty(target.numel(), dtype=torch.uint8, device=device)
                    broadcast(self._group, buffer[: target.numel()])
                    target.copy_(buffer[: target.numel()])
            except Exception as error:  # noqa: BLE001
                self.forget()  # a failed collective leaves the group unusable: the next update makes a new one
                done(error)
            else:
                done(None)

        self._jobs.put(job)

    def forget(self) -> None:
        """Drop the current group (after a failure, or when the trainer left) and the receive buffer."""
        self._group = self._group_key = self._store = self._buffer = None

    def close(self) -> None:
        """Stop the thread after the jobs already queued."""
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - a failing callback must not end the thread
                logger.exception("weight transport job failed")
