"""What a RolloutClient call is made of: the caller's `PromptGroup`, the `GroupResult` (or, for a weight push, the
`PushResult`) it gets back, the errors it may raise, and the state the I/O thread keeps for it (`Call`, and
`AsyncSink` for coroutines)."""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass, field
from typing import Any

from rollout.config import SamplingParams
from rollout.service.protocol import Completion, Delta


@dataclass
class PromptGroup:
    """A prompt to sample `n` completions of (a GRPO group)."""

    prompt_ids: list[int]
    n: int = 1
    # A rollout.SamplingParams, or a dict of its field names: temperature, top_p, max_new_tokens, seed, ...
    sampling: SamplingParams | dict[str, Any] = field(default_factory=dict)
    group_id: str | None = None


@dataclass
class GroupResult:
    """All completions of a group, in sample order."""

    group_id: str
    prompt_ids: list[int]
    completions: list[Completion]


class RolloutError(RuntimeError):
    """A worker refused or failed a request, or no answer came in time.

    Attributes:
        code: the worker's error code ("bad_request", "busy", "timeout", "no_workers", ...).
        field: the offending field, when one was named.
    """

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(f"{code}: {message}" + (f" (field {field})" if field else ""))
        self.code = code
        self.field = field


class WorkerBusy(RolloutError):
    """The worker's queue is full; retry later or add workers."""


@dataclass
class WorkerLost:
    """Put in every open weight update's replies when the client declares a worker dead (the push goes on without
    it)."""

    address: str


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


@dataclass
class Call:
    group: PromptGroup
    cost: int
    # Where Delta, GroupResult or RolloutError events go: a queue.SimpleQueue, or an AsyncSink for coroutines.
    events: Any = field(default_factory=queue.SimpleQueue)
    worker: int | None = None
    stream: bool = False
    # Per sample index: tokens handed to the caller, and tokens received from the current worker. After a failover
    # the new worker resends from token 0 (same seed, same tokens); only positions >= delivered are passed on.
    delivered: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    # The id the current worker knows the group by: the group id at first, "<group id>~retry<k>" after a failover,
    # so a resubmission never collides with the first run (still running on a worker that was only slow).
    wire_id: str = ""
    attempts: int = 0
    cancelled: bool = False  # the caller gave up on it (a failover finishes it instead of resubmitting)


class AsyncSink:
    """Where the I/O thread puts a call's events when the caller is a coroutine: straight into an asyncio.Queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, event: Any) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def next(self, timeout: float, group_id: str) -> Delta | GroupResult:
        try:
            event = await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise RolloutError("timeout", f"group {group_id!r}: no answer in time") from None
        if isinstance(event, RolloutError):
            raise event
        return event
