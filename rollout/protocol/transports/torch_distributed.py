"""Transport "torch.distributed": each bucket broadcast over a process group the trainer (rank 0) and every worker
of the push join, gloo from host memory or NCCL from GPU memory, straight into its place in the workers' staging
areas. A group is made per push (a kept one would dangle after a worker restarts) and needs every worker to the end.

The rendezvous and the group's plumbing, both sides: `rollout.protocol.dist`.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from rollout.protocol.dist import (
    DistReceiver,
    broadcast,
    check_dist_fields,
    host_towards,
    make_process_group,
    make_store,
    shutdown_group,
)
from rollout.protocol.staging import bucket_span
from rollout.protocol.transports.base import Receiver, Sender, StagingArea, UpdateRejected, WeightTransport
from rollout.protocol.weight_messages import TensorPiece, WeightsBegin, WeightsBucket


class DistSender(Sender):
    bytes_on_device = True
    survives_a_lost_worker = False  # the group counts on every worker: one lost ends the push

    def __init__(self, push: Any):
        super().__init__(push)
        self.store: Any = None  # the rendezvous store, hosted here
        self.group: Any = None
        self._fields: dict[str, Any] = {}

    def begin_fields(self, rank: int) -> dict[str, Any]:
        if not self._fields:
            self._fields = self._make_store()
        return dict(self._fields, rank=rank)

    def _make_store(self) -> dict[str, Any]:
        """A new rendezvous store and group key for this push (a group is never reused: a worker that restarted,
        or another trainer's push in between, would leave a kept one dangling)."""
        push = self.push
        try:
            host = push.dist_host or host_towards([link.address for link in push.links])
        except ValueError as error:
            raise UpdateRejected("bad_update", "dist_host", str(error)) from None
        world_size = 1 + len(push.links)
        self.store = make_store(host, 0, world_size, True, push.timeout)
        return {
            "host": host,
            "port": self.store.port,
            "world_size": world_size,
            "rank": 1,
            "backend": push.dist_backend,
            "group": uuid.uuid4().hex,
        }

    def joined(self) -> None:
        """Join the push's group as rank 0. The workers join on receiving their begin; a worker that refuses the
        begin never joins, so its refusal is watched for meanwhile and raised at once."""
        push, fields = self.push, self._fields
        outcome: list[Any] = []

        def join() -> None:
            try:
                group = make_process_group(
                    self.store, fields["group"], 0, fields["world_size"], push.dist_backend, push.timeout
                )
                outcome.append(group)
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread, as its text: the error's
                # traceback holds this thread's frames, the store among their locals, and they hold `outcome`: a
                # cycle that would keep the store's sockets and thread open until a garbage collection.
                outcome.append(str(error) or type(error).__name__)

        # Not a daemon: a join abandoned by a refused push runs until its own deadline (`timeout`), and an interpreter
        # that exits meanwhile waits for it; a daemon thread inside torch's rendezvous at exit aborts the process.
        thread = threading.Thread(target=join, name="rollout-weights-join", daemon=False)
        thread.start()
        deadline = time.monotonic() + push.timeout
        while thread.is_alive() and time.monotonic() < deadline:
            push.watch_replies(0.05)
        thread.join(max(0.0, deadline - time.monotonic()))
        if not outcome or isinstance(outcome[0], str):
            reason = outcome[0] if outcome else f"no rendezvous within {push.timeout:g} s"
            raise UpdateRejected("dist", None, f"the workers did not join the torch.distributed group: {reason}")
        self.group = outcome[0]

    def send_bucket(
        self, link: Any, header: WeightsBucket, bucket: list[tuple[int, int, torch.Tensor]], offsets: list[int]
    ) -> Any:
        self.push.channel.send(link.index, header)
        return None

    def bucket_sent(self, bucket: list[tuple[int, int, torch.Tensor]], offsets: list[int]) -> None:
        try:  # one broadcast per bucket, straight into its place in the workers' staging areas
            broadcast(self.group, bucket_span(bucket, offsets))
        except Exception as error:  # noqa: BLE001 - e.g. a worker died mid-broadcast
            raise UpdateRejected("dist", None, f"broadcast to the workers failed: {error}") from None

    def close(self) -> None:
        shutdown_group(self.group)  # now, not at a collection: its sockets would hold the process a minute at exit
        self.group = self.store = None


class DistTransportReceiver(Receiver):
    def __init__(self, device: torch.device):
        super().__init__(device)
        self._dist: DistReceiver | None = None  # made at the first torch.distributed update

    def check_begin(self, begin: WeightsBegin, peer: str | None) -> None:
        culprit = check_dist_fields(begin.dist)
        if culprit is not None:
            raise UpdateRejected("bad_update", culprit, "missing or wrong (host, port, world_size, rank, ...)")
        _check_dist_host(begin.dist.get("host"), peer)

    def when_ready(
        self, begin: WeightsBegin, reply: Callable[[BaseException | None], None], cancelled: Callable[[], bool]
    ) -> bool:
        if self._dist is None:
            self._dist = DistReceiver()
        self._dist.join(begin.dist, begin.timeout_s, reply, cancelled=cancelled)
        return False

    def accept_bucket(self, area: StagingArea, pieces: list[TensorPiece], frames: list) -> None:
        super().accept_bucket(area, pieces, frames)
        bucket_staging_span(
            area, pieces
        )  # checked here, on the serving thread: a bad bucket is refused before anything waits

    def take_bytes(
        self, area: StagingArea, begin: WeightsBegin, pieces: list[TensorPiece], frames: list, checksum: int | None
    ) -> None:
        """One broadcast per bucket, straight into its place in staging; then its bytes checked and counted."""
        assert self._dist is not None  # joined before weights_ready
        device = self.device if begin.dist["backend"] == "nccl" else torch.device("cpu")
        try:
            self._dist.receive([bucket_staging_span(area, pieces)] if pieces else [], device)
        except Exception as error:  # noqa: BLE001 - reported to the update, which is rejected
            raise UpdateRejected("bad_update", "dist", f"broadcast failed: {error}") from None
        area.verify(pieces, area.staging_views(pieces), checksum)
        area.mark_received(pieces)

    def ended(self, begin: WeightsBegin, clean: bool) -> None:
        if not clean and self._dist is not None:
            self._dist.forget()  # the trainer may be stuck mid-broadcast: the group goes

    def close(self) -> None:
        if self._dist is not None:
            self._dist.close()


def bucket_staging_span(area: StagingArea, pieces: list[TensorPiece]) -> torch.Tensor:
    """The staging bytes from the first piece's start to the last piece's end, alignment gaps included: a bucket is
    received in one broadcast. Its pieces must follow one another: each but the last ends its tensor, and the next
    starts the next tensor (`announce` checked each piece).

    Raises:
        UpdateRejected: pieces that leave a tensor unfinished, skip one, or go back.
    """
    for before, after in zip(pieces, pieces[1:]):
        if (
            before.offset + before.nbytes != area.sizes[before.index]
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
    if not pieces:
        return area.staging[:0]
    first, last = pieces[0], pieces[-1]
    start = area.offsets[first.index] + first.offset
    return area.staging[start : area.offsets[last.index] + last.offset + last.nbytes]


def _check_dist_host(host: object, peer: str | None) -> None:
    """torch.distributed makes the worker connect to `host`: only to the host the announcement came from (or to
    this machine, when it came from this machine), so a message cannot aim the worker at a third party. The host
    must be an IP address (no name lookup on the serving thread)."""
    if not isinstance(host, str):
        return  # the field check names a missing or mistyped host
    try:
        wanted = ipaddress.ip_address(host)
    except ValueError:
        raise UpdateRejected("bad_update", "dist.host", f"{host[:80]!r} is not an IP address") from None
    if peer is not None and str(wanted) == peer.removeprefix("::ffff:"):
        return
    local_peer = peer is None or ipaddress.ip_address(peer.split("%")[0]).is_loopback  # ipc/inproc: this machine
    if local_peer and _is_this_machine(str(wanted)):
        return
    raise UpdateRejected(
        "bad_update",
        "dist.host",
        f"{host!r} is not the host this weights_begin came from ({peer or 'this machine'}); the worker only connects "
        "back to it",
    )


def _is_this_machine(address: str) -> bool:
    if ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return True
    probe = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    try:
        probe.bind((address, 0))  # only an address of one of this machine's interfaces can be bound
        return True
    except OSError:
        return False
    finally:
        probe.close()


TRANSPORT = WeightTransport("torch.distributed", DistSender, DistTransportReceiver)
