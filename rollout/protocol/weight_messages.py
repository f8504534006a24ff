"""The weight update's messages: the trainer announces tensors (`weights_begin`), sends their bytes in buckets, then
commits or aborts; the worker answers each step. How the bytes travel is the transport's (`rollout.protocol.transports`).
A served LoRA adapter is removed by `adapter_unload` (no bytes travel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from rollout.protocol.message_base import ClientMessage, WorkerMessage


# ---- client -> worker --------------------------------------------------------------------------------------------
@dataclass
class TensorSpec:
    """One tensor of a weight update (travels as a map)."""

    name: str  # as in the model's state_dict
    dtype: str  # torch dtype without "torch.": "bfloat16", "float32", ...
    shape: list[int]


@dataclass
class TensorPiece:
    """Bytes [offset, offset + nbytes) of announced tensor `index` (travels as a map inside a bucket)."""

    index: int
    offset: int
    nbytes: int


@dataclass
class WeightsSpec(ClientMessage):
    """Ask which tensors (names, dtypes, shapes) a weight update may target."""

    TYPE: ClassVar[str] = "weights_spec"
    update_id: str


@dataclass
class WeightsBegin(ClientMessage):
    """Open a weight update: announce every tensor it brings. Nothing changes until `weights_commit`."""

    TYPE: ClassVar[str] = "weights_begin"
    update_id: str
    tensors: list[TensorSpec]
    version: int | None = None  # the new policy version (above the current one); nil: current + 1
    mode: str = "keep"  # in-flight samples at commit: "keep", "recompute", "abort" or "wait"
    transport: str = "frames"  # how bucket bytes travel: one of WEIGHT_TRANSPORTS
    partial: bool = False  # allow leaving parameters out
    timeout_s: float = 60.0  # deadline of every phase (and of the drain for mode "wait")
    # torch.distributed only: {"host", "port", "world_size", "rank", "backend", "group"} of the process group.
    dist: dict[str, Any] = field(default_factory=dict)
    preempt: bool = False  # take the update slot over from another client's open update (which is rejected)
    # A LoRA adapter update: its name (the tensors are "<module>.lora_A" / "<module>.lora_B"), served unmerged.
    adapter: str | None = None
    scalings: dict[str, float] = field(default_factory=dict)  # the adapter's scaling per module
    # The base weights this update is for. An update of base weights (whole or partial) makes its base_id the
    # worker's (nil when it names none: the weights changed, unnamed); an adapter update with one is refused
    # ("base_mismatch") unless the worker serves that base or brings it along.
    base_id: str | None = None


@dataclass
class WeightsBucket(ClientMessage):
    """Bytes of some announced tensors. With transport "frames" one raw frame per piece follows the header; with
    "shm" the pieces were written into the staging segment; with "torch.distributed" they follow as one broadcast
    per piece, in order."""

    TYPE: ClassVar[str] = "weights_bucket"
    update_id: str
    pieces: list[TensorPiece]
    checksum: int | None = None  # xxh3_64 of the pieces' bytes in order (rollout.protocol.staging.bucket_checksum)


@dataclass
class WeightsCommit(ClientMessage):
    """Validate that every announced tensor arrived whole, then apply the update between two engine steps."""

    TYPE: ClassVar[str] = "weights_commit"
    update_id: str


@dataclass
class WeightsAbort(ClientMessage):
    """Drop an open update (the old weights keep serving)."""

    TYPE: ClassVar[str] = "weights_abort"
    update_id: str


@dataclass
class AdapterUnload(ClientMessage):
    """Stop serving LoRA adapter `adapter`: its groups, queued or running, end with finish_reason "abort", then its
    slot is freed. Not a transaction of the update slot: it runs between two engine steps even while an update is
    open (one that then commits an adapter of that name serves it again)."""

    TYPE: ClassVar[str] = "adapter_unload"
    update_id: str  # any id the client chose: the answer carries it
    adapter: str


# ---- worker -> client --------------------------------------------------------------------------------------------
@dataclass
class WeightsSpecReply(WorkerMessage):
    """The tensors a weight update may target (state_dict names, tied aliases and persistent buffers included)."""

    TYPE: ClassVar[str] = "weights_spec_reply"
    update_id: str
    tensors: list[TensorSpec]
    policy_version: int
    base_id: str | None = None  # the base weights served, as the last whole update named them (nil: unnamed)
    adapters: dict[str, int] = field(default_factory=dict)  # served LoRA adapters and their versions
    # Other names of the same base weights, bit for bit: those of adapter updates that brought them while they were
    # served (two trainers of one checkpoint). An adapter update naming one of them needs no base.
    base_aliases: list[str] = field(default_factory=list)


@dataclass
class WeightsReady(WorkerMessage):
    """Answer to weights_begin: the update is staged here, send the buckets."""

    TYPE: ClassVar[str] = "weights_ready"
    update_id: str
    staging_bytes: int
    shm_name: str | None = None  # transport "shm": the segment to write the tensors into, at `staging_offsets`


@dataclass
class WeightsAck(WorkerMessage):
    """Answer to weights_bucket and weights_abort."""

    TYPE: ClassVar[str] = "weights_ack"
    update_id: str
    received_bytes: int
    state: str = "staging"  # "staging", or "aborted"


@dataclass
class WeightsCommitted(WorkerMessage):
    """Answer to weights_commit: the new weights serve from the next engine step on."""

    TYPE: ClassVar[str] = "weights_committed"
    update_id: str
    version: int
    pause_ms: float  # how long the engine stood still
    copy_ms: float  # of which copying tensors into the model
    drain_ms: float = 0.0  # mode "wait": how long in-flight samples ran before the update
    aborted: int = 0
    recomputed: int = 0


@dataclass
class AdapterUnloaded(WorkerMessage):
    """Answer to adapter_unload: the adapter is no longer served."""

    TYPE: ClassVar[str] = "adapter_unloaded"
    update_id: str
    adapter: str
    aborted: int = 0  # samples of its groups that ended with finish_reason "abort"
