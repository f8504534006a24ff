"""The wire protocol's messages: one dataclass per message type (generation and liveness here, weight updates in
`weight_messages.py`, what they share in `message_base.py`) and the registry of every type. What each message means
and how it travels is in protocol.py; the codec is codec.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import rollout.protocol.weight_messages  # noqa: F401 - its message types join the registry below
from rollout.protocol.message_base import ClientMessage, Message, WorkerMessage


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
    # A secret the client draws once (RolloutClient: 128 random bits, hex): speculative decoding's drafts are shared
    # only among groups of one connection and one session, so a connection that takes over a gone client's routing
    # id (ZeroMQ lets a client choose its own) draws on none of its drafts. At most 64 characters; "": none (the
    # group shares drafts with no other group).
    session: str = ""


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
class FrameArray:
    """An array carried in a raw frame after the message's header (reply_frames.py), never as nested lists: `frame`
    indexes the frames that follow the header; `shape` and `dtype` ("uint8", "int16", "int32" or "float32") its
    row-major layout. A client receives the array itself (numpy) in the same field."""

    frame: int
    shape: list[int]
    dtype: str


@dataclass(kw_only=True)
class SampleArrays:
    """The arrays a sample's message (`Delta`, `Completion`) may carry, each in a raw frame after the header
    (`FrameArray`; a client gets the numpy array in the same field); keyword-only.

    Attributes:
        routes: with sampling.return_routes (an MoE model): row i the experts of the forward that sampled token i
            (tokens, MoE layers, top_k); a client gets a numpy int16 array.
        prompt_routes: with sampling.return_routes: the prompt's positions before its last (prompt_len - 1, MoE
            layers, top_k); on a delta, the sample's first only.
        top_token_ids: with sampling.top_logprobs = k: (tokens, k), row i the k most likely tokens at token i's
            position, most likely first (int32); id -1 pads a distribution of fewer than k tokens.
        top_logprobs: alongside, their log-probs (float32, in the request's logprob mode; NaN where padded).
        prompt_logprobs: with sampling.prompt_logprobs: (prompt_len - 1,) float32, row i log p(prompt[i + 1] |
            prompt[:i + 1]) (fp32 log_softmax of the raw logits); on a delta, the sample's first only (as the
            other prompt fields).
        prompt_logprob_ranks: alongside, (prompt_len - 1,) int32, each of those tokens' rank in its distribution (1:
            the most likely).
        prompt_top_token_ids: with sampling.prompt_logprobs = k > 0: (prompt_len - 1, k), row i the k most likely
            tokens at prompt position i + 1 (int32).
        prompt_top_logprobs: alongside, their log-probs (float32).
    """

    routes: FrameArray | None = None
    prompt_routes: FrameArray | None = None
    top_token_ids: FrameArray | None = None
    top_logprobs: FrameArray | None = None
    prompt_logprobs: FrameArray | None = None
    prompt_logprob_ranks: FrameArray | None = None
    prompt_top_token_ids: FrameArray | None = None
    prompt_top_logprobs: FrameArray | None = None


@dataclass
class Delta(SampleArrays, WorkerMessage):
    """New tokens of one streaming sample (only the new ones), and their arrays (`SampleArrays`).

    Attributes:
        group_id: the sample's group.
        sample_index: the sample's index in its group.
        token_ids: the new tokens.
        logprobs: one log-probability per new token.
        policy_version: the policy version that sampled them.
    """

    TYPE: ClassVar[str] = "delta"
    group_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    policy_version: int


@dataclass
class Completion(SampleArrays):
    """One finished sample of a group (travels as a map inside GroupResult), and its arrays (`SampleArrays`).

    Attributes:
        sample_index: the sample's index in its group.
        token_ids: the completion's tokens.
        logprobs: one log-probability per token (in the request's logprob mode).
        finish_reason: why it ended: "stop", "length", "abort" or "error".
        error: what failed, when finish_reason is "error".
        policy_versions: run-length encoded policy versions: [version, index of the first token it sampled] pairs.
        kv_version_min: the oldest policy version behind this sample's KV, or behind KV it held before that newer
            weights sampled its tokens over.
        adapter: the LoRA adapter that sampled it; None: the base model.
        adapter_version: that adapter's version when the sample finished.
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
