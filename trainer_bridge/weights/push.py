"""One weight push, as a transaction per worker (`push_weights` in weight_sync.py drives it): weights_spec from
every worker, weights_begin, buckets of at most `bucket_bytes` (two in flight per worker), then weights_commit once
every worker staged the whole update."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from rollout import protocol as p
from rollout.protocol.staging import DTYPES, bucket_checksum, staging_layout
from rollout.protocol.transports import transport_named
from rollout.protocol.transports.base import Sender, UpdateRejected
from trainer_bridge.client import RolloutClient, RolloutError
from trainer_bridge.client.calls import PushResult, WorkerLost
from trainer_bridge.gathering import Entry, as_wire_bytes
from trainer_bridge.weights.commit_outcome import commit_results
from trainer_bridge.weights.lora_push import AdapterPush
from trainer_bridge.weights.push_links import NoReply, PushLink, WorkerFailed
from trainer_bridge.weights.wire_specs import cast_for_wire, wire_specs

logger = logging.getLogger("trainer_bridge.weights.weight_sync")

# Buckets in flight per worker: the next one travels while the previous is staged. "auto" sends an update that fits
# in one bucket (an adapter, a small partial update) as frames: mapping the worker's segment and touching its pages
# costs more than copying a few MB through ZeroMQ.
_WINDOW = 2


class WeightPush:
    """One push from the main process (see `push_weights`)."""

    def __init__(
        self,
        client: RolloutClient,
        entries: list[Entry],
        version: int | None,
        mode: str,
        bucket_bytes: int,
        transport: str,
        timeout: float,
        partial: bool,
        dist_host: str | None,
        dist_backend: str,
        preempt: bool = False,
        adapter: AdapterPush | None = None,
    ):
        self.client = client
        self.adapter = adapter  # an adapter-only push (lora_push.py): entries are chosen in _plan
        self.base_included = False
        self.entries = entries
        self.version = version
        self.mode = mode
        self.bucket_bytes = bucket_bytes
        self.transport = transport
        self.timeout = timeout
        self.partial = partial
        self.dist_host = dist_host
        self.dist_backend = dist_backend
        self.preempt = preempt
        self.update_id = uuid.uuid4().hex
        self.channel = client.open_update_channel(self.update_id)
        self.links = [PushLink(index, client.worker_address(index)) for index in client.wait_connected()]
        self.lost: list[PushLink] = []  # links of workers lost during the push (their segments are closed at the end)
        self.fetched = 0  # entries gathered so far (the rest are gathered by close() on failure)
        self.senders: dict[str, Sender] = {}  # the transports this push uses, by name (`sender`)

    # ---- the phases -------------------------------------------------------------------------------------------
    def run(self) -> PushResult:
        if not self.links:
            raise RolloutError("no_workers", "no live rollout worker to push weights to")
        started = time.perf_counter()
        try:
            specs = self._plan()
            self._begin(specs)
            self._send_buckets(specs)
            transfer_s = time.perf_counter() - started
            results = self._commit()
        except WorkerFailed as failure:
            error = failure.error
            raise RolloutError(
                error.code, f"worker {failure.link.address} rejected the weight update: {error.message}", error.field
            ) from None
        except UpdateRejected as refused:  # this side's half of the transport could not go on
            raise RolloutError(refused.code, refused.reason, refused.field) from None
        total_bytes = staging_layout(specs)[1]
        versions = {result["version"] for result in results}
        if len(versions) != 1:
            raise RolloutError("version_mismatch", f"workers now serve different versions: {results}")
        version = versions.pop()
        self.client.min_policy_version = max(self.client.min_policy_version, version)
        total_s = time.perf_counter() - started
        return PushResult(version, total_bytes, transfer_s, total_s, results, self.base_included)

    def _plan(self) -> list[p.TensorSpec]:
        """Ask every worker for its tensors; check names and shapes here, before gathering anything; choose the
        wire dtype of each tensor (floating tensors travel in the worker's dtype)."""
        for link in self.links:
            self.channel.send(link.index, p.WeightsSpec(self.update_id))
        self._wait(lambda: [link for link in self.links if link.specs is None], self.timeout, "weights_spec")
        # (A version not above the workers' is refused by them at weights_begin, after the key's role is checked: a
        # generate-only key hears "unauthorized", its real problem; nothing is gathered before either answer.)
        if self.version is None:
            # One number for every worker, above what any serves and what this client pushed: each adding one to its
            # own would tag the same weights differently on a restarted worker (and leave it below the client's
            # newest version, never routed to again).
            self.version = max(self.client.min_policy_version, *(link.policy_version for link in self.links)) + 1
        reference = self.links[0].specs
        for link in self.links[1:]:
            if link.specs != reference:
                raise RolloutError(
                    "bad_update",
                    f"workers {self.links[0].address} and {link.address} serve models "
                    "with different tensors; push to each separately",
                )
        adapter_names: set[str] = set()
        if self.adapter is not None:  # the base travels along where a worker does not hold it
            self.entries = self.adapter.choose(any(not link.holds_base(self.adapter.base_id) for link in self.links))
            self.base_included = bool(self.adapter.base_included)
            adapter_names = {entry.name for entry in self.adapter.entries}
        return wire_specs(self.entries, reference, adapter_names)

    def _begin(self, specs: list[p.TensorSpec]) -> None:
        small = staging_layout(specs)[1] <= self.bucket_bytes
        for rank, link in enumerate(self.links, start=1):
            link.transport = ("frames" if small else "shm") if self.transport == "auto" else self.transport
            self._send_begin(link, specs, self.sender(link.transport).begin_fields(rank))
        for sender in list(self.senders.values()):
            sender.joined()
        deadline = time.monotonic() + self.timeout
        while not all(link.ready is not None for link in self.links):
            try:
                self._receive(deadline - time.monotonic(), "weights_ready")
            except WorkerFailed as failure:
                link = failure.link
                # Only a staging area the worker could not make (field "transport") falls back: any other refusal
                # (preempted by another trainer, a version, a role) is this push's answer, not a transport's.
                if self.transport != "auto" or link.transport != "shm" or failure.error.field != "transport":
                    raise
                link.transport, link.open = "frames", False  # the worker could not make a segment
                self._send_begin(link, specs, {})
                continue
            for link in self.links:
                if link.ready is not None and not link.attached:
                    self._attach(link, specs)

    def sender(self, transport: str) -> Sender:
        """This push's sender of `transport` (a known name), made at its first use."""
        if transport not in self.senders:
            self.senders[transport] = transport_named(transport).sender(self)
        return self.senders[transport]

    def watch_replies(self, seconds: float) -> None:
        """Read the workers' replies for up to `seconds` (a refusal raises `WorkerFailed`)."""
        with contextlib.suppress(NoReply):
            self._receive(seconds, "weights_ready", quiet=True)

    def _send_begin(self, link: PushLink, specs: list[p.TensorSpec], dist_fields: dict[str, Any]) -> None:
        link.open = True
        link.ready = None
        link.attached = False
        begin = p.WeightsBegin(
            self.update_id,
            specs,
            self.version,
            self.mode,
            link.transport,
            self.partial,
            self.timeout,
            dist_fields,
            self.preempt,
        )
        if self.adapter is not None:
            begin.adapter, begin.scalings, begin.base_id = (
                self.adapter.name,
                self.adapter.scalings,
                self.adapter.base_id,
            )
        self.channel.send(link.index, begin)

    def _attach(self, link: PushLink, specs: list[p.TensorSpec]) -> None:
        """Reach the worker's staging (shm: open its segment); where that fails (another host), fall back to
        frames with transport "auto"."""
        assert link.ready is not None
        try:
            self.sender(link.transport).attach(link, link.ready, specs)
        except OSError as error:
            if self.transport != "auto":
                raise RolloutError(
                    "bad_update", f"cannot open {link.address}'s shared memory: {error}", "transport"
                ) from None
            logger.info("worker %s does not share this host's memory (%s); using frames", link.address, error)
            self.channel.send(link.index, p.WeightsAbort(self.update_id))  # the worker drops it, then begins anew
            link.transport = "frames"
            self._send_begin(link, specs, {})
            return
        link.attached = True

    def _send_buckets(self, specs: list[p.TensorSpec]) -> None:
        offsets, _ = staging_layout(specs)
        on_device = all(self.sender(link.transport).bytes_on_device for link in self.links)
        bucket: list[tuple[int, int, torch.Tensor]] = []  # (tensor index, byte offset in the tensor, bytes)
        used = 0
        for index, (entry, spec) in enumerate(zip(self.entries, specs)):
            tensor = entry.fetch()
            self.fetched += 1
            tensor = cast_for_wire(entry.name, tensor, DTYPES[spec.dtype])  # refused if it overflows the dtype
            data = as_wire_bytes(tensor, DTYPES[spec.dtype], on_device)
            start = 0
            while start < data.numel() or (data.numel() == 0 and start == 0):
                take = min(self.bucket_bytes - used, data.numel() - start)
                bucket.append((index, start, data[start : start + take]))
                used += take
                start += take
                if used >= self.bucket_bytes:
                    self._flush(bucket, offsets)
                    bucket, used = [], 0
                if data.numel() == 0:
                    break
        if bucket:
            self._flush(bucket, offsets)
        self._wait(lambda: [link for link in self.links if link.pending], self.timeout, "weights_ack")

    def _flush(self, bucket: list[tuple[int, int, torch.Tensor]], offsets: list[int]) -> None:
        pieces = [p.TensorPiece(index, offset, data.numel()) for index, offset, data in bucket]
        staged = None  # the bucket's bytes in the workers' segments (shm), hashed where they are
        for sender in list(self.senders.values()):
            staged = sender.stage(bucket, offsets) or staged
        # The worker checks what it staged against this. Buckets broadcast from GPU memory (NCCL) are hashed from a
        # host copy: one device-to-host copy of the update, the price of catching a corrupted transfer.
        checksum = bucket_checksum(staged if staged is not None else (data.cpu() for _, _, data in bucket))
        header = p.WeightsBucket(self.update_id, pieces, checksum)
        for link in list(self.links):
            self._wait(functools.partial(self._window_full, link), self.timeout, "ack")
            if link not in self.links:
                continue
            link.pending.append(self.sender(link.transport).send_bucket(link, header, bucket, offsets))
        for sender in list(self.senders.values()):
            sender.bucket_sent(bucket, offsets)

    def _commit(self) -> list[dict[str, Any]]:
        sent = list(self.links)  # a worker lost after this may have committed: it still counts if it said so
        for link in sent:
            self.channel.send(link.index, p.WeightsCommit(self.update_id))
        drain = self.timeout if self.mode == "wait" else 0.0
        deadline = time.monotonic() + self.timeout + drain
        failed: dict[int, p.Error] = {}
        try:
            # Hear from every worker, even after a failure: the error must say which ones now serve the new weights.
            while not all(link.committed is not None or link.index in failed for link in self.links):
                try:
                    self._receive(deadline - time.monotonic(), "commit")
                except WorkerFailed as failure:
                    failed[failure.link.index] = failure.error
        finally:  # whatever went wrong elsewhere (a refusal, a timeout): groups go to the workers that committed,
            # those lost after saying so included (one that answers again serves the new weights)
            if committed_versions := [link.committed.version for link in sent if link.committed is not None]:
                self.client.min_policy_version = max(self.client.min_policy_version, *committed_versions)
        assert self.version is not None  # chosen in _plan
        return commit_results(sent, self.links, failed, self.version)

    # ---- replies ----------------------------------------------------------------------------------------------
    def _window_full(self, link: Any) -> list:
        """[link] while its window of buckets in flight is full (it is waited for), else []."""
        return [link] if link in self.links and len(link.pending) >= _WINDOW else []

    def _wait(self, waiting: Callable[[], list], timeout: float, what: str) -> None:
        """Receive until no worker's link is `waiting` for `what`; a timeout names the workers still waited for."""
        deadline = time.monotonic() + timeout
        while pending := waiting():
            try:
                self._receive(deadline - time.monotonic(), what)
            except RolloutError as error:
                if error.code != "timeout":
                    raise
                silent = ", ".join(link.address for link in pending)
                raise RolloutError(
                    "timeout", f"weight update: no {what} from {silent} within {self.timeout:g} s"
                ) from None

    def _receive(self, timeout: float, what: str, quiet: bool = False) -> None:
        try:
            index, message = self.channel.receive(timeout)
        except RolloutError as error:
            if error.code == "closed":  # the client closed during the push: no answer will come
                raise
            if quiet:
                raise NoReply from None
            message = f"weight update: no {what} within {self.timeout:g} s"
            if what == "commit":  # sent: a worker that is only slow applies it when it reads it (an abort comes after)
                message += "; the commit was sent, so a worker that did not answer may still apply it: check stats()"
            raise RolloutError("timeout", message) from None
        if isinstance(message, WorkerLost):  # the client declared it dead: the update goes on with the others
            if not any(link.index == index for link in self.links):
                return  # not one of this push's workers (or already dropped)
            lost = next(link for link in self.links if link.index == index)
            transport = lost.transport if self.transport == "auto" else self.transport  # (before begin, too)
            cause = lost.loss_cause(self.bucket_bytes)
            if not transport_named(transport).sender.survives_a_lost_worker:  # e.g. a process group needs every worker
                raise RolloutError("worker_lost", f"worker {message.address} was lost during the weight update{cause}")
            self.lost += [link for link in self.links if link.index == index]
            self.links = [link for link in self.links if link.index != index]
            if not self.links:
                reason = f"every worker was lost during the weight update ({message.address}){cause}"
                raise RolloutError("no_workers", reason)
            if cause:
                logger.warning("worker %s was lost during weight update %s%s", message.address, self.update_id, cause)
            return
        link = next((link for link in self.links if link.index == index), None)
        if link is not None:
            link.take(message)

    def close(self) -> None:
        """Abort what is still open on the workers, finish every gather (other ranks are in them too), release
        shared memory and the channel."""
        for link in self.links + self.lost:
            if link.open:
                self.channel.send(link.index, p.WeightsAbort(self.update_id))
            link.pending.clear()
        try:
            if self.adapter is not None and self.adapter.base_included is None:  # failed before choosing: no base
                self.entries = self.adapter.choose(False)
            for entry in self.entries[self.fetched :]:
                entry.fetch()
            self.fetched = len(self.entries)
        finally:  # now, not at a collection (a group's sockets, a mapped segment), whatever a gather raised
            for name, sender in self.senders.items():
                try:
                    sender.close()
                except Exception:  # noqa: BLE001 - the others are still released
                    logger.warning("closing the %s transport of update %s failed", name, self.update_id, exc_info=True)
            self.senders.clear()  # each holds this push (and so the client, the entries): not a cycle
            self.channel.close()
