"""Weight sync: push a trainer's weights to every rollout worker as one transaction per worker.

    push_weights(client, model, version=step)                       # plain torch / HF model
    push_weights(client, model, version=step, accelerator=accel)    # accelerate (DDP, DeepSpeed ZeRO-3, FSDP2)

With accelerate (or any multi-process trainer) call it on every rank: only the main process sends, while every rank
takes part in gathering sharded parameters (ZeRO-3: one parameter at a time; FSDP2 DTensors: one at a time), so no
rank ever holds the whole model twice. A PEFT model sends its merged weights (base + LoRA delta) under the base
model's names, without LoRA tensors, and is left unmodified.

How a push runs, per worker: `weights_spec` (the worker's names, dtypes, shapes; floating tensors are cast to the
worker's dtype), `weights_begin`, buckets of at most `bucket_bytes` (two in flight per worker), `weights_commit`.
Commits are sent only once every worker staged the whole update, so a bad update is rejected everywhere before any
worker changes. Transports: "frames" (raw ZeroMQ frames), "shm" (the worker's staging area is a shared-memory
segment the trainer writes into: one copy, same host only), "torch.distributed" (buckets broadcast over a process
group of the trainer and the workers: gloo on CPU, NCCL on GPU; multi-node), and "auto" (shm where the worker shares
this host's shared memory, else frames).

Plain loops, the two-line hook after `optimizer.step()`:

    if step % sync_every == 0:
        push_weights(client, model, version=step, accelerator=accelerator)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.config import WEIGHT_UPDATE_MODES, dtype_name
from rollout.service import protocol as p
from rollout.service.dist import broadcast, make_process_group, make_store
from rollout.service.staging import DTYPES, attach_shared_memory, bucket_checksum, staging_layout
from trainer_bridge.client import RolloutClient, RolloutError

logger = logging.getLogger(__name__)

__all__ = ["PushResult", "iter_weights", "push_weights", "weight_specs"]

DEFAULT_BUCKET_BYTES = 64 << 20
TRANSPORTS = ("auto", "frames", "shm", "torch.distributed")
_WINDOW = 2  # buckets in flight per worker: the next one travels while the previous is staged


@dataclass
class PushResult:
    """What a push did.

    Attributes:
        version: the policy version every worker now serves.
        num_bytes: bytes of the update (per worker).
        transfer_s: seconds from the first begin to the last bucket acknowledged by every worker.
        total_s: seconds of the whole push, commits included.
        workers: per worker: address, transport, version, pause_ms, copy_ms, drain_ms, aborted, recomputed.
    """

    version: int
    num_bytes: int
    transfer_s: float
    total_s: float
    workers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        """Update bytes per second of transfer, per worker (1 GB = 1e9 bytes)."""
        return self.num_bytes / max(self.transfer_s, 1e-9) / 1e9


# ---- gathering ---------------------------------------------------------------------------------------------------
@dataclass
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    fetch: Callable[[], torch.Tensor]  # gathers if needed: every rank must call it, in the same order


def _is_zero3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(tensor, DTensor) or isinstance(getattr(tensor, "data", None), DTensor)


@contextlib.contextmanager
def _gathered(params: list[torch.Tensor]) -> Iterator[None]:
    """Make ZeRO-3-partitioned `params` whole for the duration (a collective: every rank enters it)."""
    partitioned = [param for param in params if _is_zero3(param)]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def _full_copy(param: torch.Tensor) -> torch.Tensor:
    """A whole, detached copy of one parameter or buffer (gathered if sharded)."""
    if _is_dtensor(param):
        return param.full_tensor().detach()
    if _is_zero3(param):
        with _gathered([param]):
            return param.data.detach().clone()
    return param.detach()


def _shape_of(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(param.ds_shape) if _is_zero3(param) else tuple(param.shape)


def _unwrap(model: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    while type(model).__name__ in ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine") and hasattr(
        model, "module"
    ):
        model = model.module
    return getattr(model, "_orig_mod", model)  # torch.compile wrapper


def _module_entries(model: torch.nn.Module) -> list[_Entry]:
    entries = [
        _Entry(name, param.dtype, _shape_of(param), lambda param=param: _full_copy(param))
        for name, param in model.named_parameters()
    ]
    return entries + _buffer_entries(model)


def _buffer_entries(model: torch.nn.Module, rename: Callable[[str], str | None] = lambda name: name) -> list[_Entry]:
    """Persistent buffers (they are in the state_dict); `rename` maps a name, or drops it by returning None."""
    entries = []
    for module_name, module in model.named_modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer is None or buffer_name in module._non_persistent_buffers_set:
                continue
            name = rename(f"{module_name}.{buffer_name}" if module_name else buffer_name)
            if name is not None:
                entries.append(_Entry(name, buffer.dtype, tuple(buffer.shape), lambda b=buffer: _full_copy(b)))
    return entries


def _peft_entries(model: torch.nn.Module) -> list[_Entry]:
    """Merged weights of a PEFT LoRA model under the base model's names: W + sum of the active adapters' deltas,
    computed per layer (the model is not modified), with no LoRA tensors."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model()
    prefix = getattr(model, "prefix", None) or getattr(model.base_model, "prefix", "lora_")
    modules = dict(base.named_modules())
    for name, module in modules.items():
        if isinstance(module, BaseTunerLayer) and (
            not isinstance(module, LoraLayer) or any(getattr(module, "use_dora", {}).values())
        ):
            raise NotImplementedError(
                f"{name}: only LoRA adapters (without DoRA) can be merged on the fly; merge_and_unload() the model "
                "into a plain one to sync it"
            )

    def base_name(name: str) -> str | None:
        """The base model's name of a PEFT model's tensor; None for adapter tensors and frozen originals."""
        parts = name.split(".")
        if any(part.startswith(prefix) for part in parts) or "original_module" in parts:
            return None  # adapter tensors, and the frozen originals of modules_to_save
        if "modules_to_save" in parts:
            at = parts.index("modules_to_save")
            if parts[at + 1] != modules[".".join(parts[:at])].active_adapter:
                return None
            parts = parts[:at] + parts[at + 2 :]
        if len(parts) >= 2 and parts[-2] == "base_layer":
            parts = parts[:-2] + parts[-1:]
        return ".".join(parts)

    entries = []
    for name, param in base.named_parameters():
        clean = base_name(name)
        if clean is None:
            continue
        layer = modules.get(name.rsplit(".base_layer.", 1)[0]) if ".base_layer." in name else None
        if isinstance(layer, LoraLayer) and name.endswith(".base_layer.weight"):
            entries.append(_Entry(clean, param.dtype, _shape_of(param), lambda lr=layer, w=param: _merged(lr, w)))
        else:
            entries.append(_Entry(clean, param.dtype, _shape_of(param), lambda param=param: _full_copy(param)))
    return entries + _buffer_entries(base, base_name)


def _merged(layer: Any, weight: torch.Tensor) -> torch.Tensor:
    """Base weight + the LoRA deltas of the active, not yet merged adapters of one layer."""
    with _gathered(list(layer.parameters())), torch.no_grad():
        merged = weight.detach().clone()
        for adapter in layer.active_adapters:
            known = adapter in getattr(layer, "lora_A", {}) or adapter in getattr(layer, "lora_embedding_A", {})
            if known and adapter not in layer.merged_adapters:
                merged += layer.get_delta_weight(adapter).to(merged.dtype)
        return merged.full_tensor() if _is_dtensor(merged) else merged  # FSDP2: the whole tensor, not a shard


def _entries(source: Any, accelerator: Any) -> list[_Entry]:
    if isinstance(source, torch.nn.Module):
        model = _unwrap(source, accelerator)
        if any(type(module).__name__ == "FullyShardedDataParallel" for module in model.modules()):
            raise NotImplementedError(
                "FSDP1 (FullyShardedDataParallel) flat parameters are not supported; shard with FSDP2 (fully_shard, "
                "accelerate's fsdp_version=2), whose parameters are gathered one at a time"
            )
        if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
            return _peft_entries(model)
        return _module_entries(model)
    expected = "expected an nn.Module, a dict of name -> torch.Tensor, or an iterable of (name, tensor) pairs"
    if isinstance(source, (str, bytes)) or not isinstance(source, (Mapping, Iterable)):
        raise TypeError(f"{expected}, got {type(source).__name__}")
    entries = []
    for item in source.items() if isinstance(source, Mapping) else source:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"{expected}; got an item {type(item).__name__} {item!r:.60}")
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{expected}; got ({type(name).__name__}, {type(tensor).__name__})")
        entries.append(_Entry(name, tensor.dtype, tuple(tensor.shape), lambda t=tensor: _full_copy(t)))
    return entries


def weight_specs(model_or_named_tensors: Any, accelerator: Any = None) -> dict[str, tuple[torch.dtype, tuple]]:
    """Name -> (dtype, full shape) of what `push_weights` would send, without gathering anything.

    Args:
        model_or_named_tensors: an nn.Module (plain, accelerate-prepared, ZeRO-3, FSDP2 or PEFT), or a dict /
            iterable of (name, tensor).
        accelerator: the `accelerate.Accelerator` that prepared the model, if any.
    """
    return {entry.name: (entry.dtype, entry.shape) for entry in _entries(model_or_named_tensors, accelerator)}


def iter_weights(model_or_named_tensors: Any, accelerator: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, whole tensor) one at a time, gathering sharded parameters as it goes. In a multi-process run
    every rank must iterate it to the end (the gathers are collectives). Arguments as for `weight_specs`."""
    for entry in _entries(model_or_named_tensors, accelerator):
        yield entry.name, entry.fetch()


# ---- pushing -----------------------------------------------------------------------------------------------------
@dataclass
class _Link:
    """One worker's side of a push."""

    index: int
    address: str
    transport: str = "frames"
    specs: dict[str, tuple[str, tuple[int, ...]]] | None = None
    version: int = 0  # the worker's policy version before the push
    ready: p.WeightsReady | None = None
    committed: p.WeightsCommitted | None = None
    open: bool = False  # begun, neither committed nor rejected
    segment: Any = None  # shm transport: the attached SharedMemory
    staging: torch.Tensor | None = None  # shm transport: a uint8 view of the segment
    pending: deque = field(default_factory=deque)  # buckets sent, not acknowledged (their data kept alive)


class _NoReply(Exception):
    """No reply within a short poll."""


class _WorkerFailed(Exception):
    def __init__(self, link: _Link, error: p.Error):
        super().__init__(error.message)
        self.link = link
        self.error = error


def push_weights(
    client: RolloutClient | None,
    model_or_named_tensors: Any,
    version: int | None = None,
    mode: str = "keep",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    transport: str = "auto",
    timeout: float = 60.0,
    accelerator: Any = None,
    partial: bool = False,
    dist_host: str = "127.0.0.1",
    dist_backend: str | None = None,
) -> PushResult | None:
    """Send weights to every live worker of `client` and make them serve them, as one transaction per worker.

    Args:
        client: the RolloutClient (None on ranks other than the main one: they only take part in gathering).
        model_or_named_tensors: an nn.Module (plain, accelerate-prepared, DeepSpeed ZeRO-3, FSDP2 or PEFT LoRA), or
            a dict / iterable of (name, tensor) under the worker model's state_dict names.
        version: the new policy version (e.g. the trainer's global step; must grow); None: each worker adds one.
        mode: in-flight samples at commit: "keep", "recompute", "abort" or "wait" (see `Engine.update_weights`).
        bucket_bytes: most bytes per bucket (the sender holds at most two buckets per worker in flight).
        transport: "auto", "frames", "shm" or "torch.distributed".
        timeout: deadline in seconds of every phase, on both sides (and of the drain in mode "wait").
        accelerator: the `accelerate.Accelerator` of a multi-process run (only its main process sends).
        partial: send only some parameters (else the workers insist on all of them).
        dist_host: torch.distributed: an address of this host the workers can reach (the rendezvous store).
        dist_backend: torch.distributed backend: "gloo" or "nccl" (default: nccl when CUDA is available).
    Returns:
        A `PushResult` on the main process, None elsewhere.
    Raises:
        RolloutError: a worker rejected the update (its `field` names the culprit tensor or setting), or a phase
            timed out; no worker changed its weights unless the error says a commit failed.
        ValueError: a bad argument.
    """
    if mode not in WEIGHT_UPDATE_MODES:
        raise ValueError(f"mode must be one of {list(WEIGHT_UPDATE_MODES)}, got {mode!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {transport!r}")
    if not isinstance(bucket_bytes, int) or not 1 <= bucket_bytes <= p.MAX_FRAME_BYTES:
        raise ValueError(f"bucket_bytes must be in [1, {p.MAX_FRAME_BYTES}], got {bucket_bytes!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    entries = _entries(model_or_named_tensors, accelerator)
    is_main = client is not None and (accelerator is None or accelerator.is_main_process)
    if not is_main:
        for entry in entries:  # take part in every gather the main process runs
            entry.fetch()
        return None
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    try:
        push = _Push(client, entries, version, mode, bucket_bytes, transport, timeout, partial, dist_host, backend)
    except BaseException:
        for entry in entries:  # the other ranks are in these gathers: finish them before raising
            entry.fetch()
        raise
    try:
        return push.run()
    finally:
        push.close()


class _Push:
    """One push from the main process (see `push_weights`)."""

    def __init__(
        self,
        client: RolloutClient,
        entries: list[_Entry],
        version: int | None,
        mode: str,
        bucket_bytes: int,
        transport: str,
        timeout: float,
        partial: bool,
        dist_host: str,
        dist_backend: str,
    ):
        self.client = client
        self.entries = entries
        self.version = version
        self.mode = mode
        self.bucket_bytes = bucket_bytes
        self.transport = transport
        self.timeout = timeout
        self.partial = partial
        self.dist_host = dist_host
        self.dist_backend = dist_backend
        self.update_id = uuid.uuid4().hex
        self.channel = client.open_update_channel(self.update_id)
        self.links = [_Link(index, client.worker_addresses[index]) for index in client.wait_connected()]
        self.fetched = 0  # entries gathered so far (the rest are gathered by close() on failure)
        self.group: Any = None  # torch.distributed group for this push

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
        except _WorkerFailed as failure:
            error = failure.error
            raise RolloutError(
                error.code, f"worker {failure.link.address} rejected the weight update: {error.message}", error.field
            ) from None
        total_bytes = staging_layout(specs)[1]
        versions = {result["version"] for result in results}
        if len(versions) != 1:
            raise RolloutError("version_mismatch", f"workers now serve different versions: {results}")
        version = versions.pop()
        self.client.min_policy_version = max(self.client.min_policy_version, version)
        return PushResult(version, total_bytes, transfer_s, time.perf_counter() - started, results)

    def _plan(self) -> list[p.TensorSpec]:
        """Ask every worker for its tensors; check names and shapes here, before gathering anything; choose the
        wire dtype of each tensor (floating tensors travel in the worker's dtype)."""
        for link in self.links:
            self.channel.send(link.index, p.WeightsSpec(self.update_id))
        self._wait(lambda: all(link.specs is not None for link in self.links), self.timeout, "weights_spec")
        current = max(link.version for link in self.links)
        if self.version is not None and self.version <= current:
            raise RolloutError("bad_update", f"must exceed the workers' current version {current}", "version")
        reference = self.links[0].specs
        for link in self.links[1:]:
            if link.specs != reference:
                raise RolloutError(
                    "bad_update",
                    f"workers {self.links[0].address} and {link.address} serve models "
                    "with different tensors; push to each separately",
                )
        specs = []
        for entry in self.entries:
            target = reference.get(entry.name)
            if target is None:
                raise RolloutError("bad_update", "the workers' model has no tensor of this name", entry.name)
            dtype_wire, shape = target
            if tuple(shape) != tuple(entry.shape):
                raise RolloutError(
                    "bad_update", f"shape {list(entry.shape)} does not match the workers' {list(shape)}", entry.name
                )
            if not (entry.dtype.is_floating_point and DTYPES[dtype_wire].is_floating_point):
                dtype_wire = dtype_name(entry.dtype)  # never cast integers: a mismatch is for the worker to name
            specs.append(p.TensorSpec(entry.name, dtype_wire, list(entry.shape)))
        return specs

    def _begin(self, specs: list[p.TensorSpec]) -> None:
        dist_fields: dict[str, Any] = {}
        if self.transport == "torch.distributed":
            dist_fields = self._dist_fields()
        for link in self.links:
            link.transport = "shm" if self.transport == "auto" else self.transport
            fields = dict(dist_fields, rank=1 + self.links.index(link)) if dist_fields else {}
            self._send_begin(link, specs, fields)
        if self.transport == "torch.distributed":
            self._join_group(dist_fields)
        deadline = time.monotonic() + self.timeout
        while not all(link.ready is not None for link in self.links):
            try:
                self._receive(deadline - time.monotonic(), "weights_ready")
            except _WorkerFailed as failure:
                link = failure.link
                if self.transport != "auto" or link.transport != "shm":
                    raise
                link.transport, link.open = "frames", False  # the worker could not make a segment
                self._send_begin(link, specs, {})
                continue
            for link in self.links:
                if link.ready is not None and link.transport == "shm" and link.segment is None:
                    self._attach(link, specs)

    def _send_begin(self, link: _Link, specs: list[p.TensorSpec], dist_fields: dict[str, Any]) -> None:
        link.open = True
        link.ready = None
        begin = p.WeightsBegin(
            self.update_id, specs, self.version, self.mode, link.transport, self.partial, self.timeout, dist_fields
        )
        self.channel.send(link.index, begin)

    def _attach(self, link: _Link, specs: list[p.TensorSpec]) -> None:
        """Open the worker's staging segment; where that fails (another host), fall back to frames."""
        expected = staging_layout(specs)[1]
        try:
            segment = attach_shared_memory(link.ready.shm_name)
            if segment.size < expected:
                segment.close()
                raise OSError(f"segment of {segment.size} bytes, expected {expected}")
        except OSError as error:
            if self.transport == "shm":
                raise RolloutError(
                    "bad_update", f"cannot open {link.address}'s shared memory: {error}", "transport"
                ) from None
            logger.info("worker %s does not share this host's memory (%s); using frames", link.address, error)
            self.channel.send(link.index, p.WeightsAbort(self.update_id))  # the worker drops it, then begins anew
            link.transport = "frames"
            self._send_begin(link, specs, {})
            return
        link.segment = segment
        link.staging = torch.frombuffer(segment.buf, dtype=torch.uint8)

    def _join_group(self, fields: dict[str, Any]) -> None:
        """Join the push's process group as rank 0. The workers join on receiving their begin; a worker that
        refuses the begin never joins, so its refusal is watched for meanwhile and raised at once."""
        outcome: list[BaseException | Any] = []

        def join() -> None:
            try:
                outcome.append(
                    make_process_group(
                        self.store, fields["group"], 0, fields["world_size"], self.dist_backend, self.timeout
                    )
                )
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                outcome.append(error)

        thread = threading.Thread(target=join, name="rollout-weights-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout
        while thread.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(_NoReply):
                self._receive(0.05, "weights_ready", quiet=True)
        thread.join(max(0.0, deadline - time.monotonic()))
        if not outcome or isinstance(outcome[0], BaseException):
            reason = outcome[0] if outcome else f"no rendezvous within {self.timeout:g} s"
            raise RolloutError("dist", f"the workers did not join the torch.distributed group: {reason}")
        self.group = outcome[0]

    def _dist_fields(self) -> dict[str, Any]:
        """A new rendezvous store and group key for this push (a group is never reused: a worker that restarted,
        or another trainer's push in between, would leave a kept one dangling)."""
        self.store = make_store(self.dist_host, 0, 1 + len(self.links), True, self.timeout)
        return {
            "host": self.dist_host,
            "port": self.store.port,
            "world_size": 1 + len(self.links),
            "rank": 1,
            "backend": self.dist_backend,
            "group": uuid.uuid4().hex,
        }

    def _send_buckets(self, specs: list[p.TensorSpec]) -> None:
        offsets, _ = staging_layout(specs)
        bucket: list[tuple[int, int, torch.Tensor]] = []  # (tensor index, byte offset in the tensor, bytes)
        used = 0
        for index, (entry, spec) in enumerate(zip(self.entries, specs)):
            tensor = entry.fetch()
            self.fetched += 1
            data = _as_bytes(tensor, DTYPES[spec.dtype], self.transport == "torch.distributed")
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
        self._wait(lambda: all(not link.pending for link in self.links), self.timeout, "weights_ack")

    def _flush(self, bucket: list[tuple[int, int, torch.Tensor]], offsets: list[int]) -> None:
        pieces = [p.TensorPiece(index, offset, data.numel()) for index, offset, data in bucket]
        # The worker checks what it staged against this; NCCL broadcasts from GPU memory carry none (hashing them
        # would cost a copy to the host).
        on_host = all(data.device.type == "cpu" for _, _, data in bucket)
        checksum = bucket_checksum(data for _, _, data in bucket) if on_host else None
        header = p.WeightsBucket(self.update_id, pieces, checksum)
        for link in self.links:
            self._wait(lambda link=link: len(link.pending) < _WINDOW, self.timeout, "weights_ack")
            if link.transport == "frames":
                cpu = [data.cpu() for _, _, data in bucket]
                self.channel.send(link.index, header, [memoryview(d.numpy()) for d in cpu])
                link.pending.append(cpu)
            elif link.transport == "shm":
                for index, offset, data in bucket:
                    start = offsets[index] + offset
                    link.staging[start : start + data.numel()].copy_(data)
                self.channel.send(link.index, header)
                link.pending.append(None)
            else:
                self.channel.send(link.index, header)
                link.pending.append(None)
        if self.transport == "torch.distributed":
            try:  # one broadcast per piece, each straight into its place in the workers' staging areas
                for _, _, data in bucket:
                    broadcast(self.group, data)
            except Exception as error:  # noqa: BLE001 - e.g. a worker died mid-broadcast
                raise RolloutError("dist", f"broadcast to the workers failed: {error}") from None

    def _commit(self) -> list[dict[str, Any]]:
        for link in self.links:
            self.channel.send(link.index, p.WeightsCommit(self.update_id))
        drain = self.timeout if self.mode == "wait" else 0.0
        deadline = time.monotonic() + self.timeout + drain
        failed: dict[int, p.Error] = {}
        # Hear from every worker, even after a failure: the error must say which ones now serve the new weights.
        while not all(link.committed is not None or link.index in failed for link in self.links):
            try:
                self._receive(deadline - time.monotonic(), "commit")
            except _WorkerFailed as failure:
                failed[failure.link.index] = failure.error
        if failed:
            first = next(link for link in self.links if link.index in failed)
            committed = [f"{link.address} (version {link.committed.version})" for link in self.links if link.committed]
            if not committed:
                raise _WorkerFailed(first, failed[first.index])
            errors = "; ".join(
                f"{link.address}: {failed[link.index].message}" for link in self.links if link.index in failed
            )
            raise RolloutError(
                "partial_commit",
                f"the commit failed on some workers ({errors}) while {', '.join(committed)} committed: the workers "
                "now serve different weights; push again",
                failed[first.index].field,
            )
        results = []
        for link in self.links:
            done = link.committed
            results.append(
                {
                    "address": link.address,
                    "transport": link.transport,
                    "version": done.version,
                    "pause_ms": done.pause_ms,
                    "copy_ms": done.copy_ms,
                    "drain_ms": done.drain_ms,
                    "aborted": done.aborted,
                    "recomputed": done.recomputed,
                }
            )
        return results

    # ---- replies ----------------------------------------------------------------------------------------------
    def _wait(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            self._receive(deadline - time.monotonic(), what)

    def _receive(self, timeout: float, what: str, quiet: bool = False) -> None:
        try:
            index, message = self.channel.receive(timeout)
        except RolloutError:
            if quiet:
                raise _NoReply from None
            raise RolloutError("timeout", f"weight update: no {what} within {self.timeout:g} s") from None
        link = next((link for link in self.links if link.index == index), None)
        if link is None:
            return
        if isinstance(message, p.Error):
            link.open = False
            raise _WorkerFailed(link, message)
        if isinstance(message, p.WeightsSpecReply):
            link.specs = {spec.name: (spec.dtype, tuple(spec.shape)) for spec in message.tensors}
            link.version = message.policy_version
        elif isinstance(message, p.WeightsReady):
            link.ready = message
        elif isinstance(message, p.WeightsAck):
            if message.state == "staging" and link.pending:
                link.pending.popleft()
        elif isinstance(message, p.WeightsCommitted):
            link.committed = message
            link.open = False

    def close(self) -> None:
        """Abort what is still open on the workers, finish every gather (other ranks are in them too), release
        shared memory and the channel."""
        for link in self.links:
            if link.open:
                self.channel.send(link.index, p.WeightsAbort(self.update_id))
            link.pending.clear()
            link.staging = None
            if link.segment is not None:
                with contextlib.suppress(BufferError):
                    link.segment.close()
        for entry in self.entries[self.fetched :]:
            entry.fetch()
        self.fetched = len(self.entries)
        self.group = None
        self.channel.close()


def _as_bytes(tensor: torch.Tensor, dtype: torch.dtype, keep_device: bool) -> torch.Tensor:
    """The tensor in the wire dtype as a flat uint8 tensor (on the CPU unless `keep_device`)."""
    tensor = tensor.detach()
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if not keep_device:
        tensor = tensor.cpu()
    return tensor.contiguous().reshape(-1).view(torch.uint8)
