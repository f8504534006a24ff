"""The wire protocol's messages: one dataclass per message type, the limits a decoded header must respect, and
`ProtocolError`. What each message means and how it travels is in protocol.py; the codec is codec.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

PROTOCOL_VERSION = 2  # 2: torch.distributed buckets travel as one broadcast each (1: one per piece)
# The nonce of the unsolicited pong a worker may send to check that a client's connection is still up.
PROBE_NONCE = -1
# Largest frame a worker accepts (a weight bucket's pieces are split below it); larger ones drop the connection.
MAX_FRAME_BYTES = 256 << 20
# Most items of any list or map in a header, and the longest string or bytes value in one (tensor bytes travel in
# frames of their own): checked while msgpack decodes, so an oversized list is refused before it is built.
MAX_HEADER_ITEMS = 1 << 20
MAX_HEADER_STR = 1 << 20
# Most maps and lists in a header together (each costs an object to build: a header of a million tiny maps took a
# second to decode); a weight update's pieces and tensors are bounded below it.
MAX_HEADER_CONTAINERS = 1 << 17
# Largest header frame (a prompt of a million tokens is ~5 MB, an update announcing 65,536 tensors ~15 MB).
MAX_HEADER_BYTES = 32 << 20


class ProtocolError(ValueError):
    """A message that cannot be decoded or has a wrong field.

    Attributes:
        field: the offending field ("header" when the bytes are not a message at all, "type" for unknown types).
        reason: what is wrong with it.
        group_id, update_id: the message's ids when its header still had string ones (so the answer can be routed
            to the waiting call), else None.
    """

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
        self.group_id: str | None = None
        self.update_id: str | None = None


@dataclass
class Message:
    """Base of every wire message; subclasses set TYPE."""

    TYPE: ClassVar[str] = ""


@dataclass
class ClientMessage(Message):
    """A message a client sends a worker (a request)."""


@dataclass
class WorkerMessage(Message):
    """A message a worker sends a client (an answer)."""


# ---- client -> worker --------------------------------------------------------------------------------------------
@dataclass
class Hello(ClientMessage):
    """Ask the worker what it serves."""

    TYPE: ClassVar[str] = "hello"


@dataclass
class Generate(ClientMessage):
    """Generate `n` samples of one prompt (a GRPO group); the worker prefills the prompt once."""

    TYPE: ClassVar[str] = "generate"
    group_id: str
    prompt_ids: list[int]
    n: int = 1
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    adapter: str | None = None  # the served LoRA adapter to sample with; nil: the base model


@dataclass
class Cancel(ClientMessage):
    """Abort every sample of a group; its group_result comes back with finish_reason "abort"."""

    TYPE: ClassVar[str] = "cancel"
    group_id: str


@dataclass
class Ping(ClientMessage):
    """Liveness check (heartbeat)."""

    TYPE: ClassVar[str] = "ping"
    nonce: int = 0


@dataclass
class Stats(ClientMessage):
    """Ask for the worker's counters."""

    TYPE: ClassVar[str] = "stats"


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
    # The base weights this update is for. A whole update with a base_id makes it the worker's; an adapter update
    # with one is refused ("base_mismatch") unless the worker serves that base.
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


# ---- worker -> client --------------------------------------------------------------------------------------------
@dataclass
class HelloReply(WorkerMessage):
    """What the worker serves."""

    TYPE: ClassVar[str] = "hello_reply"
    model: str
    vocab_size: int
    max_model_len: int
    policy_version: int
    config: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = None  # where the worker's tokenizer came from; None: it has none (no stop strings)


@dataclass
class RouteArray:
    """MoE routes carried in a raw frame after the message's header (route_frames.py): `frame` indexes the frames
    that follow the header; (rows, MoE layers, top_k) integers of `dtype` ("uint8" or "int16"), row-major. A client
    receives them as numpy int16 arrays in the same field."""

    frame: int
    shape: list[int]
    dtype: str


@dataclass
class Delta(WorkerMessage):
    """New tokens of one streaming sample (only the new ones).

    Attributes:
        group_id: the sample's group.
        sample_index: the sample's index in its group.
        token_ids: the new tokens.
        logprobs: one log-probability per new token.
        policy_version: the policy version that sampled them.
        routes: with sampling.return_routes: the new tokens' routes (a client gets a numpy int16 array).
        prompt_routes: with sampling.return_routes, on the sample's first delta: its prompt's routes.
    """

    TYPE: ClassVar[str] = "delta"
    group_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    policy_version: int
    routes: RouteArray | None = None
    prompt_routes: RouteArray | None = None


@dataclass
class Completion:
    """One finished sample of a group (travels as a map inside GroupResult).

    Attributes:
        sample_index: the sample's index in its group.
        token_ids: the completion's tokens.
        logprobs: one log-probability per token (in the request's logprob mode).
        finish_reason: why it ended: "stop", "length", "abort" or "error".
        error: what failed, when finish_reason is "error".
        policy_versions: run-length encoded policy versions: [version, index of the first token it sampled] pairs.
        kv_version_min: the oldest policy version behind this sample's KV.
        adapter: the LoRA adapter that sampled it; None: the base model.
        adapter_version: that adapter's version when the sample finished.
        routes: with sampling.return_routes (an MoE model): row i the experts of the forward that sampled token i
            (tokens, MoE layers, top_k); a client gets a numpy int16 array.
        prompt_routes: with sampling.return_routes: the prompt's positions before its last (prompt_len - 1, MoE
            layers, top_k).
        cached_prompt_tokens: prompt tokens the prefix cache spared it (their KV computed earlier).
    """

    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    error: str | None = None
    policy_versions: list[list[int]] = field(default_factory=list)
    kv_version_min: int = 0
    adapter: str | None = None
    adapter_version: int | None = None
    routes: RouteArray | None = None
    prompt_routes: RouteArray | None = None
    cached_prompt_tokens: int = 0


@dataclass
class GroupResult(WorkerMessage):
    """Every sample of a group, once all finished: the worker's `group_result` message, and what `RolloutClient`
    returns (one class on both sides of the wire).

    Attributes:
        group_id: the group's id (`PromptGroup.group_id`, or the one the client made).
        prompt_ids: the prompt's token ids.
        completions: one `Completion` per sample, in sample order.
    """

    TYPE: ClassVar[str] = "group_result"
    group_id: str
    prompt_ids: list[int]
    completions: list[Completion]


@dataclass
class Pong(WorkerMessage):
    """Answer to ping."""

    TYPE: ClassVar[str] = "pong"
    nonce: int
    policy_version: int


@dataclass
class StatsReply(WorkerMessage):
    """The worker's counters."""

    TYPE: ClassVar[str] = "stats_reply"
    stats: dict[str, Any]


@dataclass
class WeightsSpecReply(WorkerMessage):
    """The tensors a weight update may target (state_dict names, tied aliases and persistent buffers included)."""

    TYPE: ClassVar[str] = "weights_spec_reply"
    update_id: str
    tensors: list[TensorSpec]
    policy_version: int
    base_id: str | None = None  # the base weights served, as the last whole update named them (nil: unnamed)
    adapters: dict[str, int] = field(default_factory=dict)  # served LoRA adapters and their versions


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
class Error(WorkerMessage):
    """A request was refused or failed; `field` names the culprit when a field was wrong (for weight updates: the
    tensor's name, or a weights_begin field)."""

    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    field: str | None = None
    group_id: str | None = None
    update_id: str | None = None


def _concrete(base: type) -> list[type]:
    found = []
    for cls in base.__subclasses__():
        found += [cls] if cls.TYPE else []
        found += _concrete(cls)
    return found


MESSAGE_TYPES: dict[str, type[Message]] = {cls.TYPE: cls for cls in _concrete(Message)}
# What a client may send a worker (the rest are the worker's answers).
REQUEST_TYPES = frozenset(kind for kind, cls in MESSAGE_TYPES.items() if issubclass(cls, ClientMessage))
