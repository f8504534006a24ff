"""The wire protocol between trainers and rollout workers: every message is a dataclass, one codec turns it into
bytes. `trainer_bridge` imports this module and `rollout.service.sockets` (nothing else from `rollout`).

Transport: ZeroMQ multipart messages. A worker binds a ROUTER socket; clients connect DEALER sockets (the ROUTER
adds and strips the client's identity frame). Frame 0 of every message is a msgpack map, the header:

    {"protocol": 1, "type": "<message type>", <the message's fields>}

Frames after the header carry raw tensor bytes (weight updates only), described by the header, never pickled.
Decoding checks the protocol version, the type, and every field's presence and type; anything wrong raises
`ProtocolError`, whose `field` names the culprit ("header" for undecodable bytes), and the worker answers with an
`Error` message carrying that field.

Messages (client -> worker, then what the worker answers):

| type           | fields                                                               | answer                          |
|----------------|----------------------------------------------------------------------|---------------------------------|
| hello          | -                                                                    | hello_reply                     |
| generate       | group_id: str, prompt_ids: [int], n: int = 1, sampling: {str: any} = | delta* (stream only), then      |
|                | {}, stream: bool = false                                             | group_result; or error          |
| cancel         | group_id: str                                                        | group_result (abort) or error   |
| ping           | nonce: int = 0                                                       | pong                            |
| stats          | -                                                                    | stats_reply                     |
| weights_spec   | update_id: str                                                       | weights_spec_reply              |
| weights_begin  | update_id: str, tensors: [TensorSpec], version: int or nil, mode:    | weights_ready, or error         |
|                | str = "keep", transport: str = "frames", partial: bool = false,      |                                 |
|                | timeout_s: float = 60, dist: {str: any} = {}, preempt: bool = false |                                 |
| weights_bucket | update_id: str, pieces: [TensorPiece], checksum: int or nil; + one   | weights_ack, or error (the      |
|                | raw frame per piece (transport "frames")                             | update is then dropped)         |
| weights_commit | update_id: str                                                       | weights_committed, or error     |
| weights_abort  | update_id: str                                                       | weights_ack (state "aborted")   |

Worker -> client:

| type               | fields                                                                                     |
|--------------------|--------------------------------------------------------------------------------------------|
| hello_reply        | model: str, vocab_size: int, max_model_len: int, policy_version: int, config: {str: any}   |
| delta              | group_id: str, sample_index: int, token_ids: [int], logprobs: [float], policy_version: int |
| group_result       | group_id: str, prompt_ids: [int], completions: [Completion as a map]                       |
| pong               | nonce: int, policy_version: int                                                            |
| stats_reply        | stats: {str: any} (policy_version, weight_updates, last_weight_update_at, queue, KV, ...)  |
| weights_spec_reply | update_id: str, tensors: [TensorSpec], policy_version: int                                 |
| weights_ready      | update_id: str, staging_bytes: int, shm_name: str or nil                                   |
| weights_ack        | update_id: str, received_bytes: int, state: "staging" or "aborted"                         |
| weights_committed  | update_id: str, version: int, pause_ms: float, copy_ms: float, drain_ms: float,            |
|                    | aborted: int, recomputed: int                                                              |
| error              | code: str, message: str, field: str or nil, group_id: str or nil, update_id: str or nil    |

Liveness: a worker cancels the groups of a client that has groups in flight and has sent nothing for its
`--client-timeout` (30 s by default), so a client waiting on long groups should send `ping` every few seconds. A
client whose connection closed, or that leaves more than `--max-pending-bytes` of replies unread, is dropped at
once (groups cancelled). To find out whether a connection that closed was a client's, the worker may send it an
unsolicited `pong` with nonce -1 (`PROBE_NONCE`): clients ignore pongs they did not ask for.

Limits (`rollout-worker --max-...`, answered by name): header lists and maps hold at most 2**20 items and strings
2**20 bytes (longer ones are refused before they are built); a prompt is at most `--max-prompt-len` tokens (checked
from its length first); `n` at most `--max-n`; at most `--max-groups-per-client` groups in flight ("busy" past it);
frames at most `--max-message-bytes` (a larger one drops the connection).

Security: with `--curve-secret-key` every connection is CurveZMQ-encrypted and only listed keys connect; weight
updates (weights_begin/bucket/commit/abort) need a key of `--trainer-keys`, others get "unauthorized".

A Completion map: sample_index: int, token_ids: [int], logprobs: [float], finish_reason: "stop" | "length" |
"abort" | "error", error: str or nil, policy_versions: [[version, index of the first token it sampled], ...]
(run-length encoded), kv_version_min: int (the oldest weights' version behind the sample's KV when it finished).
`sampling` takes the field names of `rollout.SamplingParams`.

Weight updates are transactions, one open at a time per worker: weights_begin announces every tensor (TensorSpec
map: name, dtype such as "bfloat16", shape) and is checked against the model at once (unknown or missing names,
wrong dtypes or shapes, a version not above the current one are refused, `field` naming the tensor or setting);
buckets carry TensorPiece maps (index: announced tensor, offset and nbytes: a byte range of it; each tensor's pieces
in order, without gaps); weights_commit checks that every announced byte arrived, then the engine copies the update
into the model in place between two steps. The staging area lays the tensors out in order, each at an offset
aligned to 64 bytes (`rollout.service.weights.staging_layout`); transport "shm" makes it a shared-memory segment
(named in weights_ready) that the client writes into; "torch.distributed" broadcasts each piece of a bucket, in
order, over the process group described by `dist` (host, port: the trainer's TCPStore; world_size; rank of this
worker, >= 1; backend "gloo" or "nccl"; group: a key, reused while it does not change). Every phase must follow the
previous one within `timeout_s`; a client that misses a deadline or disappears gets its update dropped, and the old
weights keep serving. `mode` says what happens to in-flight samples at commit: "keep" (continue on their KV),
"recompute" (re-prefill prompt + tokens so far), "abort" (end with finish_reason "abort"), "wait" (admission pauses
until in-flight samples finish, at most `timeout_s`).

Error codes: "bad_request" (a field is wrong), "busy" (the queue is full: retry later), "unknown_group",
"duplicate_group", "internal"; for weight updates: "bad_update" (`field` names the tensor or setting),
"update_timeout", "update_in_progress", "update_committing", "update_preempted", "unknown_update"; "unauthorized"
(the client's key may not do this: weight updates need a trainer key).
"""

from __future__ import annotations

import dataclasses
import functools
import reprlib
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import msgpack

PROTOCOL_VERSION = 1
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


# ---- client -> worker --------------------------------------------------------------------------------------------
@dataclass
class Hello(Message):
    """Ask the worker what it serves."""

    TYPE: ClassVar[str] = "hello"


@dataclass
class Generate(Message):
    """Generate `n` samples of one prompt (a GRPO group); the worker prefills the prompt once."""

    TYPE: ClassVar[str] = "generate"
    group_id: str
    prompt_ids: list[int]
    n: int = 1
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False


@dataclass
class Cancel(Message):
    """Abort every sample of a group; its group_result comes back with finish_reason "abort"."""

    TYPE: ClassVar[str] = "cancel"
    group_id: str


@dataclass
class Ping(Message):
    """Liveness check (heartbeat)."""

    TYPE: ClassVar[str] = "ping"
    nonce: int = 0


@dataclass
class Stats(Message):
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
class WeightsSpec(Message):
    """Ask which tensors (names, dtypes, shapes) a weight update may target."""

    TYPE: ClassVar[str] = "weights_spec"
    update_id: str


@dataclass
class WeightsBegin(Message):
    """Open a weight update: announce every tensor it brings. Nothing changes until `weights_commit`."""

    TYPE: ClassVar[str] = "weights_begin"
    update_id: str
    tensors: list[TensorSpec]
    version: int | None = None  # the new policy version (above the current one); nil: current + 1
    mode: str = "keep"  # in-flight samples at commit: "keep", "recompute", "abort" or "wait"
    transport: str = "frames"  # how bucket bytes travel: "frames", "shm" or "torch.distributed"
    partial: bool = False  # allow leaving parameters out
    timeout_s: float = 60.0  # deadline of every phase (and of the drain for mode "wait")
    # torch.distributed only: {"host", "port", "world_size", "rank", "backend", "group"} of the process group.
    dist: dict[str, Any] = field(default_factory=dict)
    preempt: bool = False  # take the update slot over from another client's open update (which is rejected)


@dataclass
class WeightsBucket(Message):
    """Bytes of some announced tensors. With transport "frames" one raw frame per piece follows the header; with
    "shm" the pieces were written into the staging segment; with "torch.distributed" they follow as one broadcast
    per piece, in order."""

    TYPE: ClassVar[str] = "weights_bucket"
    update_id: str
    pieces: list[TensorPiece]
    checksum: int | None = None  # xxh3_64 of the pieces' bytes in order (rollout.service.weights.bucket_checksum)


@dataclass
class WeightsCommit(Message):
    """Validate that every announced tensor arrived whole, then apply the update between two engine steps."""

    TYPE: ClassVar[str] = "weights_commit"
    update_id: str


@dataclass
class WeightsAbort(Message):
    """Drop an open update (the old weights keep serving)."""

    TYPE: ClassVar[str] = "weights_abort"
    update_id: str


# ---- worker -> client --------------------------------------------------------------------------------------------
@dataclass
class HelloReply(Message):
    """What the worker serves."""

    TYPE: ClassVar[str] = "hello_reply"
    model: str
    vocab_size: int
    max_model_len: int
    policy_version: int
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class Delta(Message):
    """New tokens of one streaming sample (only the new ones)."""

    TYPE: ClassVar[str] = "delta"
    group_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    policy_version: int


@dataclass
class Completion:
    """One finished sample of a group (travels as a map inside GroupResult)."""

    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    error: str | None = None
    # Run-length encoded policy versions: [version, index of the first token it sampled] pairs.
    policy_versions: list[list[int]] = field(default_factory=list)
    # Oldest policy version behind this sample's KV.
    kv_version_min: int = 0


@dataclass
class GroupResult(Message):
    """Every sample of a group, once all finished."""

    TYPE: ClassVar[str] = "group_result"
    group_id: str
    prompt_ids: list[int]
    completions: list[Completion]


@dataclass
class Pong(Message):
    """Answer to ping."""

    TYPE: ClassVar[str] = "pong"
    nonce: int
    policy_version: int


@dataclass
class StatsReply(Message):
    """The worker's counters."""

    TYPE: ClassVar[str] = "stats_reply"
    stats: dict[str, Any]


@dataclass
class WeightsSpecReply(Message):
    """The tensors a weight update may target (state_dict names, tied aliases and persistent buffers included)."""

    TYPE: ClassVar[str] = "weights_spec_reply"
    update_id: str
    tensors: list[TensorSpec]
    policy_version: int


@dataclass
class WeightsReady(Message):
    """Answer to weights_begin: the update is staged here, send the buckets."""

    TYPE: ClassVar[str] = "weights_ready"
    update_id: str
    staging_bytes: int
    shm_name: str | None = None  # transport "shm": the segment to write the tensors into, at `staging_offsets`


@dataclass
class WeightsAck(Message):
    """Answer to weights_bucket and weights_abort."""

    TYPE: ClassVar[str] = "weights_ack"
    update_id: str
    received_bytes: int
    state: str = "staging"  # "staging", or "aborted"


@dataclass
class WeightsCommitted(Message):
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
class Error(Message):
    """A request was refused or failed; `field` names the culprit when a field was wrong (for weight updates: the
    tensor's name, or a weights_begin field)."""

    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    field: str | None = None
    group_id: str | None = None
    update_id: str | None = None


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Generate,
        Cancel,
        Ping,
        Stats,
        WeightsSpec,
        WeightsBegin,
        WeightsBucket,
        WeightsCommit,
        WeightsAbort,
        HelloReply,
        Delta,
        GroupResult,
        Pong,
        StatsReply,
        WeightsSpecReply,
        WeightsReady,
        WeightsAck,
        WeightsCommitted,
        Error,
    )
}


# What a client may send a worker (the rest are the worker's answers).
REQUEST_TYPES = frozenset(
    cls.TYPE
    for cls in (
        Hello,
        Generate,
        Cancel,
        Ping,
        Stats,
        WeightsSpec,
        WeightsBegin,
        WeightsBucket,
        WeightsCommit,
        WeightsAbort,
    )
)


# ---- codec -------------------------------------------------------------------------------------------------------
def encode(message: Message) -> list[bytes]:
    """Turn a message into ZeroMQ frames (header first; raw tensor frames, if any, are appended by the sender)."""
    header = {"protocol": PROTOCOL_VERSION, "type": message.TYPE}
    for item in dataclasses.fields(message):
        header[item.name] = _plain(getattr(message, item.name))
    return [msgpack.packb(header, use_bin_type=True)]


def decode(
    frames: list[Any],
    max_items: int = MAX_HEADER_ITEMS,
    max_str: int = MAX_HEADER_STR,
    max_lengths: dict[str, int] | None = None,
    accept: Collection[str] | None = None,
) -> Message:
    """Turn ZeroMQ frames back into a message, checking version, type and every field (frames after the header,
    the raw tensor bytes of a weights_bucket, are left to the caller).

    Args:
        frames: the message's frames (bytes or zmq.Frame).
        max_items: most items of any list or map in the header (enforced while msgpack decodes, so an oversized
            list is refused before it is built), and of all lists together (checked before their elements).
        max_str: longest string or bytes value in the header.
        max_lengths: tighter bounds on named top-level list fields (e.g. {"prompt_ids": 32768}), checked from the
            list's length before its elements.
        accept: the message types to accept (e.g. REQUEST_TYPES); others are refused before their fields are
            checked.
    Raises:
        ProtocolError: naming the field that is missing, unknown, too long or of the wrong type.
    """
    if not frames:
        raise ProtocolError("header", "empty message")
    containers = [0]

    def count(value: Any) -> Any:
        containers[0] += 1
        if containers[0] > MAX_HEADER_CONTAINERS:
            raise ValueError(f"more than {MAX_HEADER_CONTAINERS} maps and lists exceeds max_containers")
        return value

    payload = _bytes(frames[0])
    if len(payload) > MAX_HEADER_BYTES:
        raise ProtocolError("header", f"{len(payload)} bytes, more than the limit of {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            object_hook=count,
            list_hook=count,
            max_array_len=max_items,
            max_map_len=max_items,
            max_str_len=max_str,
            max_bin_len=max_str,
            max_ext_len=max_str,
        )
    except ValueError as error:
        if "exceeds max_" in str(error):  # msgpack's bound check: the whole header is refused unread
            raise ProtocolError("header", f"a list, map or string is over the limit ({error})") from None
        raise ProtocolError("header", f"not a msgpack map ({type(error).__name__})") from None
    except Exception as error:  # noqa: BLE001 - any undecodable input is the sender's fault
        raise ProtocolError("header", f"not a msgpack map ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError("header", f"expected a map, got {type(header).__name__}")
    try:
        return _checked_message(header, max_items, max_lengths, accept)
    except ProtocolError as error:
        group_id, update_id = header.get("group_id"), header.get("update_id")
        error.group_id = group_id if isinstance(group_id, str) else None
        error.update_id = update_id if isinstance(update_id, str) else None
        raise


def _checked_message(
    header: dict, max_items: int, max_lengths: dict[str, int] | None, accept: Collection[str] | None
) -> Message:
    if type(header.get("protocol")) is not int or header["protocol"] != PROTOCOL_VERSION:
        raise ProtocolError(
            "protocol", f"expected protocol version {PROTOCOL_VERSION}, got {_abridged(header.get('protocol'))}"
        )
    kind = header.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None  # a list or map would be unhashable
    if cls is None:
        raise ProtocolError("type", f"unknown message type {_abridged(kind)}")
    if accept is not None and kind not in accept:  # refused before its fields are looked at
        raise ProtocolError("type", f"{kind!r} is not a request")
    for name, limit in (max_lengths or {}).items():
        value = header.get(name)
        if isinstance(value, list) and len(value) > limit:
            raise ProtocolError(name, f"{len(value)} items, more than the limit of {limit}")
    try:
        budget = [max_items]  # items of every list in the header together, checked before each list's elements
        return _build(cls, {k: v for k, v in header.items() if k not in ("protocol", "type")}, "", budget)
    except ProtocolError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever a hostile header trips on is the sender's fault
        raise ProtocolError("header", f"malformed {kind!r} message ({type(error).__name__})") from None


_SHORT = reprlib.Repr()  # bounded depth and length: a hostile value nested 1,000 deep must not recurse
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 3, 4, 4
_SHORT.maxstring = _SHORT.maxother = 60


def _abridged(value: Any) -> str:
    return _SHORT.repr(value)


def _bytes(frame: Any) -> Any:
    """The payload of a frame received with copy=False (a zmq.Frame), or the frame itself."""
    return frame.buffer if hasattr(frame, "buffer") else frame


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {item.name: _plain(getattr(value, item.name)) for item in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """(type hints, fields by name) of a message or nested dataclass (computing hints is slow: once per class)."""
    return typing.get_type_hints(cls), {item.name: item for item in dataclasses.fields(cls)}


def _build(cls: type, values: dict[str, Any], prefix: str, budget: list[int]) -> Any:
    hints, known = _schema(cls)
    extra = sorted(set(values) - set(known), key=str)
    if extra:
        raise ProtocolError(f"{prefix}{extra[0]}", f"unknown field for {getattr(cls, 'TYPE', cls.__name__)!r}")
    kwargs = {}
    for name, item in known.items():
        if name not in values:
            if item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{prefix}{name}", "missing")
            continue
        kwargs[name] = _check(values[name], hints[name], f"{prefix}{name}", budget)
    return cls(**kwargs)


@functools.cache
def _flat_schema(cls: type) -> tuple[dict[str, Any], frozenset[str]] | None:
    """(field -> int, str, bool or list[int]; required fields) of a dataclass made only of such fields, else None."""
    hints, known = _schema(cls)
    kinds = {}
    for name in known:
        hint = hints[name]
        if hint in (int, str, bool) or (typing.get_origin(hint) is list and typing.get_args(hint) == (int,)):
            kinds[name] = hint
        else:
            return None
    required = frozenset(
        name
        for name, item in known.items()
        if item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING
    )
    return kinds, required


def _fast_items(cls: type, values: list, budget: list[int]) -> list | None:
    """A list of maps of a flat dataclass (TensorPiece, TensorSpec) checked in one tight loop; None at the first
    anomaly, for the item-by-item check to name it."""
    schema = _flat_schema(cls)
    if schema is None:
        return None
    kinds, required = schema
    built, before = [], budget[0]
    for item in values:
        if type(item) is not dict or not required <= item.keys() or not item.keys() <= kinds.keys():
            return None
        for key, value in item.items():
            kind = kinds[key]
            if kind in (int, str, bool):
                if type(value) is not kind:
                    budget[0] = before
                    return None
            else:
                budget[0] -= len(value) if type(value) is list else 0
                if type(value) is not list or budget[0] < 0 or not all(type(v) is int for v in value):
                    budget[0] = before
                    return None
        built.append(cls(**item))
    return built


def _check(value: Any, annotation: Any, name: str, budget: list[int]) -> Any:
    """Return `value` if it matches `annotation` (converting maps into dataclasses), else raise naming `name`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _check(value, next(a for a in args if a is not type(None)), name, budget)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ProtocolError(name, f"expected a map, got {type(value).__name__}")
        return _build(annotation, value, f"{name}.", budget)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(name, f"expected a list, got {type(value).__name__}")
        budget[0] -= len(value)
        if budget[0] < 0:
            raise ProtocolError(name, "the message's lists hold too many items together")
        if args[0] is int:  # the long lists (token ids): one pass, no per-item call
            if not all(type(v) is int for v in value):
                index = next(i for i, v in enumerate(value) if type(v) is not int)
                raise ProtocolError(f"{name}[{index}]", f"expected int, got {type(value[index]).__name__}")
            return value
        fast = _fast_items(args[0], value, budget) if dataclasses.is_dataclass(args[0]) else None
        if fast is not None:
            return fast
        return [_check(v, args[0], f"{name}[{i}]", budget) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ProtocolError(name, "expected a map with string keys")
        return {k: _check(v, args[1], f"{name}.{k}", budget) for k, v in value.items()}
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ProtocolError(name, f"expected a number, got {type(value).__name__}")
    if annotation in (int, str, bool):
        if type(value) is not annotation:
            raise ProtocolError(name, f"expected {annotation.__name__}, got {type(value).__name__}")
        return value
    raise TypeError(f"protocol field {name} has an unsupported annotation {annotation!r}")  # a bug of ours
