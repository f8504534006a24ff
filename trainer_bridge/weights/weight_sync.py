"""Weight sync: push a trainer's weights to every rollout worker as one transaction per worker.

    push_weights(client, model, version=step)                       # plain torch / HF model
    push_weights(client, model, version=step, accelerator=accel)    # accelerate (DDP, DeepSpeed ZeRO-3, FSDP2)

With accelerate (or any multi-process trainer) call it on every rank: only the main process sends, while every rank
takes part in gathering sharded parameters (ZeRO-3: one parameter at a time; FSDP2 DTensors: one at a time), so no
rank ever holds the whole model twice.

A PEFT LoRA model sends only its active adapter (lora_A / lora_B, scalings and its modules_to_save copies), which
the workers serve unmerged under the adapter's name; the frozen base travels once, in the same transaction, to
workers that do not hold it yet (in a multi-process trainer the main process's decision reaches every rank, which
gather the same tensors). The client then samples with that adapter by default (`RolloutClient.adapter`).
`adapters="merged"` sends merged weights (base + LoRA delta) under the base model's names instead, and the client
then samples with the base, as after any push that is not adapter-only. The default, `adapters="auto"`, pushes adapter-only where the workers can serve the
adapter unmerged, else merged with one warning naming why (DoRA, a trained bias, LoRA on a non-Linear layer, a rank
above the workers' max_lora_rank, ...: `adapter_mode.py`); `adapters="adapter"` insists on adapter-only, refusing
such an adapter by name. The model is left unmodified either way.

How a push runs, per worker: `weights_spec` (the worker's names, dtypes, shapes; floating tensors are cast to the
worker's dtype), `weights_begin`, buckets of at most `bucket_bytes` (two in flight per worker), `weights_commit`.
Commits are sent only once every worker staged the whole update, so a bad update is rejected everywhere before any
worker changes. Transports: "frames" (raw ZeroMQ frames), "shm" (the worker's staging area is a shared-memory
segment the trainer writes into: one copy, same host only), "torch.distributed" (buckets broadcast over a process
group of the trainer and the workers: gloo on CPU, NCCL on GPU; multi-node), and "auto" (shm where the worker shares
this host's shared memory, else frames; frames for an update that fits in one bucket, such as an adapter).

Plain loops, the two-line hook after `optimizer.step()`:

    if step % sync_every == 0:
        push_weights(client, model, version=step, accelerator=accelerator)
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from rollout import protocol as p
from rollout.config import WEIGHT_UPDATE_MODES, FieldError
from rollout.protocol.transports import TRANSPORTS
from trainer_bridge.client import RolloutClient, RolloutError
from trainer_bridge.client.calls import PushResult, as_integer
from trainer_bridge.gathering import entries_of, iter_weights, unwrapped, weight_specs
from trainer_bridge.weights.adapter_mode import ADAPTER_MODES, push_mode, rank_refused
from trainer_bridge.weights.lora_push import AdapterPush, adapter_push
from trainer_bridge.weights.push import WeightPush
from trainer_bridge.weights.wire_specs import check_sendable

logger = logging.getLogger(__name__)

__all__ = ["PushResult", "iter_weights", "push_weights", "weight_specs"]

DEFAULT_BUCKET_BYTES = 64 << 20


def check_push_settings(
    mode: str = "keep",
    transport: str = "auto",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: float = 60.0,
    adapters: str = "auto",
    **_: Any,
) -> None:
    """Refuse, by name, a `push_weights` setting it cannot take (also what a trainer checks of its push settings
    when it is built). Other arguments are ignored here.

    Raises:
        ValueError: naming the setting.
    """
    if mode not in WEIGHT_UPDATE_MODES:
        raise ValueError(f"mode must be one of {list(WEIGHT_UPDATE_MODES)}, got {mode!r}")
    transports = ["auto", *TRANSPORTS]  # auto: shm on the worker's host (frames for an update of one bucket)
    if transport not in transports:
        raise ValueError(f"transport must be one of {transports}, got {transport!r}")
    if not isinstance(bucket_bytes, int) or not 1 <= bucket_bytes <= p.MAX_FRAME_BYTES:
        raise ValueError(f"bucket_bytes must be in [1, {p.MAX_FRAME_BYTES}], got {bucket_bytes!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if adapters not in ADAPTER_MODES:
        raise ValueError(f"adapters must be one of {list(ADAPTER_MODES)}, got {adapters!r}")


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
    dist_host: str | None = None,
    dist_backend: str | None = None,
    preempt: bool = False,
    adapters: str = "auto",
    adapter_name: str | None = None,
) -> PushResult | None:
    """Send weights to every live worker of `client` and make them serve them, as one transaction per worker.

    Args:
        client: the RolloutClient (None on ranks other than the main one: they only take part in gathering).
        model_or_named_tensors: an nn.Module (plain, accelerate-prepared, DeepSpeed ZeRO-3, FSDP2 or PEFT LoRA), or
            a dict / iterable of (name, tensor) under the worker model's state_dict names.
        version: the new policy version (e.g. the trainer's global step; must grow; an int or a numpy / torch
            integer); None: one above the newest version a worker serves or this client pushed, the same for every
            worker.
        mode: in-flight samples at commit: "keep", "recompute", "abort" or "wait" (see `Engine.update_weights`).
        bucket_bytes: most bytes per bucket (the sender holds at most two buckets per worker in flight).
        transport: "auto", "frames", "shm" or "torch.distributed".
        timeout: deadline in seconds of every phase, on both sides (and of the drain in mode "wait").
        accelerator: the `accelerate.Accelerator` of a multi-process run (only its main process sends).
        partial: send only some parameters (else the workers insist on all of them).
        dist_host: torch.distributed: an address of this host the workers can reach (the rendezvous store); default:
            the address this host reaches the first worker from (127.0.0.1 for workers on loopback).
        dist_backend: torch.distributed backend: "gloo" or "nccl" (default: nccl when CUDA is available).
        preempt: take the workers' update slot over from another client's open update (e.g. this trainer before
            a restart), which is rejected; without it such a worker answers "update_in_progress".
        adapters: for a PEFT LoRA model: "auto" (adapter-only where the workers can serve the adapter unmerged, else
            merged with one warning per model; a rank above the workers' max_lora_rank, which they refuse, is pushed
            merged at once and from then on), "adapter" (adapter-only, or a FieldError naming what cannot be served
            unmerged) or "merged" (base + LoRA delta under the base names, as a plain model).
        adapter_name: the name the workers serve the adapter under (default: its PEFT name); groups then sample
            with it unless they name another (`PromptGroup.adapter`). Given, the push is adapter-only or refused
            (a FieldError naming "adapter_name", or what cannot be served unmerged): never new base weights.
    Returns:
        A `PushResult` on the main process, None elsewhere.
    Raises:
        RolloutError: a worker rejected the update (its `field` names the culprit tensor or setting), or a phase
            timed out; no worker changed its weights unless the error says a commit failed or timed out (a worker
            that did not answer the commit may still apply it).
        ValueError: a bad argument; a `FieldError` names it: a tensor of a dtype no transport carries, or a None
            `client` in a process that is not one of several (it would push nothing).
    """
    check_push_settings(mode=mode, transport=transport, bucket_bytes=bucket_bytes, timeout=timeout, adapters=adapters)
    if version is not None:  # numpy / torch integers too, as ColocatedEngine and PromptGroup take them
        given, version = version, as_integer(version)
        if version is None or version < 0:
            reason = f"must be a non-negative integer (e.g. the trainer's global step), got {given!r}"
            raise FieldError("version", reason)
    newest = getattr(client, "min_policy_version", None)
    if version is not None and isinstance(newest, int) and version < newest:  # restarted workers would take it, and
        raise FieldError(  # then no call would go to them: the client waits for workers at its newest version
            "version",
            f"{version} is below {newest}, the newest version pushed through this client (its calls go only to "
            f"workers at {newest} or above): push {newest} or more, or leave version out",
        )
    if adapter_name is not None and (not isinstance(adapter_name, str) or not adapter_name):  # "" read as "default"
        raise FieldError("adapter_name", f"must be a non-empty string or None, got {adapter_name!r}")
    _check_client(client, accelerator)
    if adapter_name is not None and adapters == "auto":
        adapters = "adapter"  # a named adapter is served adapter-only, or refused saying why: never merged silently
    adapter = None
    how = push_mode(model_or_named_tensors, adapters, accelerator)
    if adapter_name is not None and how != "adapter":  # never a silent push of new base weights for every group
        what = "merged weights of the PEFT model" if how == "merged" else "whole weights (not a PEFT LoRA model)"
        raise FieldError(
            "adapter_name",
            f"{adapter_name!r} names an adapter, but this push sends {what}, which would replace the base model for "
            "every group; push a PEFT LoRA model with adapters='adapter' to serve it by name, or drop adapter_name",
        )
    if how == "adapter":
        model = unwrapped(model_or_named_tensors, accelerator)
        adapter = adapter_push(model, None, adapter_name, accelerator)
    if adapter is not None:  # (every rank refuses the same tensor, before any gather)
        check_sendable(adapter.entries, own_dtype=True)
        check_sendable(adapter.base_entries)
    entries = [] if adapter is not None else entries_of(model_or_named_tensors, accelerator)
    check_sendable(entries)
    is_main = client is not None and (accelerator is None or accelerator.is_main_process)
    # The workers' max_lora_rank is theirs to know: "auto" whose adapter they refuse for its rank (at weights_begin,
    # before any byte) pushes merged at once instead, every rank taking part (the main process tells them).
    fallback = how == "adapter" and adapters == "auto"
    again = dict(version=version, mode=mode, bucket_bytes=bucket_bytes, transport=transport, timeout=timeout)
    again |= dict(accelerator=accelerator, partial=partial, dist_host=dist_host, dist_backend=dist_backend)
    if not is_main:
        if adapter is not None:  # the main process says whether the base travels
            entries = adapter.choose(False)
        for entry in entries:  # take part in every gather the main process runs
            entry.fetch()
        if not (fallback and _main_says(False, accelerator)):
            return None
        rank_refused(model_or_named_tensors, None, "its rank, refused by the workers", accelerator)
        return push_weights(None, model_or_named_tensors, preempt=preempt, **again)
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    refusal: RolloutError | None = None
    try:
        settings = (version, mode, bucket_bytes, transport, timeout, partial, dist_host, backend, preempt)
        result = _run_push(client, entries, adapter, settings)
    except RolloutError as error:
        if not (fallback and adapter is not None and adapter.refused_for_rank(error)):
            raise
        refusal = error
    finally:
        if fallback:  # (on every path: the other ranks wait for the word)
            _main_says(refusal is not None, accelerator)
    if refusal is not None:
        reason = str(refusal).removeprefix(f"{refusal.code}: ").removesuffix(f" (field {refusal.field})")
        field, refusal = refusal.field, None  # its traceback holds this frame: not the error too
        rank_refused(model_or_named_tensors, field, reason, accelerator)
        return push_weights(client, model_or_named_tensors, preempt=preempt, **again)
    # The pushed policy is what the client samples from now: the adapter pushed, else the base it replaced (an
    # adapter pushed before would be sampled on top of other weights than it was trained with).
    client.adapter = adapter.name if adapter is not None else None
    return result


def _run_push(client: RolloutClient, entries: list, adapter: AdapterPush | None, settings: tuple) -> PushResult:
    """One push from the main process (`WeightPush`), every gather finished whatever fails (the other ranks of a
    multi-process trainer are in them too).

    Args:
        client: the RolloutClient.
        entries: the tensors to send (empty for an adapter push: it chooses its own).
        adapter: an adapter-only push, or None.
        settings: `WeightPush`'s arguments from `version` to `preempt`, in its order.
    """
    try:
        push = WeightPush(client, entries, *settings, adapter)
    except BaseException:
        if adapter is not None:
            entries = adapter.choose(False)
        for entry in entries:  # the other ranks are in these gathers: finish them before raising
            entry.fetch()
        raise
    try:
        return push.run()
    finally:
        push.close()


def _main_says(flag: bool, accelerator: Any) -> bool:
    """The main process's `flag`, on every rank of a multi-process trainer (a collective: every rank calls it)."""
    if accelerator is None or getattr(accelerator, "num_processes", 1) <= 1:
        return flag
    from accelerate.utils import broadcast_object_list

    return bool(broadcast_object_list([flag], from_process=0)[0])


def check_push_kwargs(push_kwargs: dict[str, Any], set_by_caller: dict[str, str], caller: str) -> None:
    """Refuse, by name, a keyword meant for `push_weights` that the caller sets itself or that `push_weights` does
    not take, then a bad value (`check_push_settings`): what a trainer or callback checks when it is built, not at
    its first push, after a whole step.

    Args:
        push_kwargs: the keywords it will pass `push_weights`.
        set_by_caller: the `push_weights` arguments the caller gives itself, and what it gives.
        caller: its name, for the errors.
    Raises:
        TypeError: naming a keyword the caller sets, or one `push_weights` does not take.
        ValueError: naming a bad setting.
    """
    taken = [name for name in inspect.signature(push_weights).parameters if name not in set_by_caller]
    for name in push_kwargs:
        if name in set_by_caller:
            raise TypeError(f"{name}: {caller} sets it ({set_by_caller[name]}); leave it out")
        if name not in taken:
            raise TypeError(f"{name}: push_weights takes no {name!r} (it takes {', '.join(taken)})")
    check_push_settings(**push_kwargs)


def _check_client(client: RolloutClient | None, accelerator: Any) -> None:
    """Refuse a None `client` outside a multi-process job: None marks the ranks that only take part in gathering,
    and a process alone has no main rank that would push (the call would silently push nothing).

    Args:
        client: `push_weights`' client.
        accelerator: `push_weights`' accelerator (its process count, where it has one).
    Raises:
        FieldError: ("client") None, with a single process.
    """
    if client is not None or _num_processes(accelerator) > 1:
        return
    raise FieldError(
        "client",
        "None is for the ranks other than the main one of a multi-process job, which only take part in gathering; "
        "this process is alone (torch.distributed is not initialized, or its world size is 1), so nothing would be "
        "pushed: give the RolloutClient",
    )


def _num_processes(accelerator: Any) -> int:
    """The processes of this job: the accelerator's count, else torch.distributed's world size (1 without it)."""
    count = getattr(accelerator, "num_processes", None)
    if isinstance(count, int):
        return count
    distributed = torch.distributed
    return distributed.get_world_size() if distributed.is_available() and distributed.is_initialized() else 1
