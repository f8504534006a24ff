"""Malformed protocol messages for a rollout worker: a seeded, deterministic generator, and a sender that fires them
from raw ZeroMQ DEALER sockets and counts what was answered.

`fuzz_cases(count, seed)` yields `FuzzCase`s (`fuzz_messages` only their frames: a msgpack header frame, sometimes
followed by raw frames). Case i of a seed is the same whatever `count` is, so `(seed, index)` names a case exactly
(`fuzz_case(seed, index)` rebuilds it). The cases cycle through every message type of
`rollout.service.protocol.MESSAGE_TYPES` (requests mostly, but also the worker's own reply types sent to it) and
every field of each (nested TensorSpec / TensorPiece / Completion fields, every `sampling` key of a generate, every
`dist` key of a weights_begin), putting there:

- values of the wrong type: list, map, bytes, nil, bool, float, NaN/inf, ints beyond int64 (up to 2**64 - 1, the
  largest msgpack holds), negative ints, msgpack ext values; unhashable values (lists and maps) where a string,
  an int or a dict key is expected;
- valid but hostile values: n = 0 / 10**9, negative or huge ids, nonces and versions, timeout_s of an hour,
  1e308, inf or NaN, token ids outside the vocabulary, prompts longer than the context, weights_begin naming
  tensors the model does not have (or absurd shapes and dtypes), dist pointing at odd hosts and ports;
- missing fields and unknown fields;

plus whole-message damage: a wrong or missing protocol version, an unknown / non-string / unhashable `type`,
headers that are not maps (lists, ints, strings), random bytes, truncated msgpack, invalid UTF-8 in a string,
non-string and duplicate map keys, values nested up to and past msgpack's depth limit, oversized values (strings,
lists and maps of 10**5 to 10**6 items, lists of 10**4 to 10**5 valid nested maps; at most 2 MB each and rare) and
raw data frames after a message that takes none. Every weights_begin the codec accepts names a tensor the model
lacks (or none at all, without `partial`), so no case opens a weight update. Within 4 * len(all_targets()) cases
(about 620) every (type, field) pair has had a wrong-typed and a hostile value.

`send_fuzz(address, count, seed)` sends the cases, each followed by a sentinel `ping` whose `pong` marks where the
worker's answers to that case end (the worker answers in order), so every reply is attributed to its case; a
request the worker accepts (a valid generate) is answered later by its group_result, matched by group id (a cancel
of such a group by that group's result too); the worker's unsolicited pongs (liveness probes) answer no case. The
socket (hence the client identity the worker sees) is replaced every `rotate_every` cases. Replies are awaited with
a bounded wait; when none comes the worker is probed, and a worker that stopped answering ends the run with the
cases in flight named as suspects. The `FuzzReport` counts sent / answered / error replies / unanswered, the slow
cases, and whether the worker still serves (a raw `hello`, a greedy `generate` through `RolloutClient`, and the
weight-update slot still free).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random
import time
import types
import typing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack
import zmq

from rollout.service import protocol as p

# What a client may send (requests), and the worker's own answers (sent to it, they must be refused by type).
REQUEST_TYPES = tuple(kind for kind in p.MESSAGE_TYPES if kind in p.REQUEST_TYPES)
WORKER_TYPES = tuple(kind for kind in p.MESSAGE_TYPES if kind not in p.REQUEST_TYPES)

# Sentinel pings carry nonces from here on (a pong is a sentinel only when its nonce is one in flight).
SENTINEL_BASE = 0x7E57_0000_0000_0000
UNKNOWN_TENSOR = "fuzz.no_such_tensor"
EXTRA_FIELD = "x"  # the field values go into for message types that have none
# Oversized values: item counts, the largest rarely (each case stays within a few MB).
OVERSIZED_ITEMS = (100_000, 300_000, 1_000_000)
# msgpack decodes up to 1024 levels of nesting; 990-1023 also trip Python's recursion limit in repr().
NESTING_DEPTHS = (16, 200, 500, 990, 1000, 1023, 1100, 5000)

# How often each kind of case comes (relative weights).
CATEGORIES = {
    "wrong_type": 30,  # one field gets a value of another type
    "hostile_value": 22,  # one field gets a valid-typed but hostile value
    "missing_field": 6,
    "unknown_field": 5,
    "protocol": 4,
    "type": 4,
    "non_map": 3,
    "random_bytes": 4,
    "truncated": 5,
    "extra_frames": 5,
    "bucket_frames": 2,
    "invalid_utf8": 2,
    "bad_keys": 2,
    "nested": 3,
    "oversized": 0.5,
    "valid": 2,
}

NAN, INF = float("nan"), float("inf")
WRONG_TYPE_VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    1,
    -1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -(2**63),
    0.5,
    -0.0,
    NAN,
    INF,
    -INF,
    1e308,
    "",
    "x",
    "1",
    "nan",
    b"",
    b"\xff\x00bytes",
    [],
    [1, 2],
    [[]],
    [None],
    ["x"],
    [{}],
    {},
    {"a": 1},
    {"": []},
    {"k": {"k": {"k": {}}}},
    msgpack.ExtType(5, b"ext"),
    msgpack.Timestamp(1, 0),  # ext type -1
)
HOSTILE_STRINGS = ("", " ", "#", "a#0", "/", "a/b/c", "\x00", "\u202e", "\U0001f600" * 50, "x" * 10_000, "null")
HOSTILE_INTS = (0, -1, -(2**31) - 1, 2**31, 10**9, 10**18, 2**63 - 1, 2**63, 2**64 - 1, -(2**63))
HOSTILE_FLOATS = (0.0, -0.0, -1.0, NAN, INF, -INF, 1e308, 5e-324, 3600.0, 1e9, 10**18, 2**64 - 1)
HOSTILE_INT_LISTS: tuple[Any, ...] = (
    [],
    [-1],
    [2**63],
    [2**64 - 1],
    [-(2**63)],
    [1024],
    [10**9],
    [0] * 2049,
    [1.5],
    [True],
    ["1"],
    [None],
    [[1]],
    [{}],
)
# Per field name: valid-typed values a hostile client might send.
HOSTILE_BY_NAME: dict[str, tuple[Any, ...]] = {
    "n": (0, -1, 10**9, 2**63 - 1, 2**64 - 1, 65, 4096),
    "nonce": (2**64 - 1, -(2**63), 0, SENTINEL_BASE - 1),
    "version": (-1, 0, 2**63 - 1, 2**63, 2**64 - 1),
    "timeout_s": (3600.0, 1e308, INF, NAN, -1.0, 0.0, 1e-9, 10**18),
    "mode": ("", "KEEP", "drop", "wait ", "x" * 1000),
    "transport": ("", "tcp", "shm ", "torch.distributed.x", "frames\x00"),
    "partial": (0, 1, "yes"),
    "stream": (0, 1, "yes"),
    "preempt": (0, 1, "yes"),
    "tensors": (
        [],
        [{"name": UNKNOWN_TENSOR, "dtype": "float32", "shape": [2**40, 2**40]}],
        [{"name": UNKNOWN_TENSOR, "dtype": "float32", "shape": [-1]}],
        [{"name": UNKNOWN_TENSOR, "dtype": "complex128", "shape": []}],
        [{"name": UNKNOWN_TENSOR, "dtype": "float32", "shape": [4]}] * 1000,
        [{"name": f"{UNKNOWN_TENSOR}.{i}", "dtype": "float32", "shape": [1]} for i in range(1000)],
        [{"name": "", "dtype": "", "shape": []}],
    ),
    "pieces": (
        [],
        [{"index": -1, "offset": 0, "nbytes": 4}],
        [{"index": 0, "offset": 2**63, "nbytes": 2**63}],
        [{"index": 2**64 - 1, "offset": -1, "nbytes": -4}],
        [{"index": 0, "offset": 0, "nbytes": 4}] * 1000,
    ),
    "dist": (
        {"host": "0.0.0.0", "port": 0},
        {"host": "256.1.1.1", "port": 65536, "world_size": 10**9, "rank": -1, "backend": "mpi", "group": []},
        {"host": "example.invalid", "port": 29500, "world_size": 2, "rank": 1, "backend": "gloo", "group": "g"},
        {"host": "127.0.0.1", "port": -1},
    ),
    "sampling": ({"max_new_tokens": 2, "seed": 2**64 - 1}, {"unknown_field": 1}, {"": 1}),
}
# Values for any `sampling.<field>` (SamplingParams takes them after the codec, which only checks a map).
HOSTILE_SAMPLING: tuple[Any, ...] = (
    NAN,
    INF,
    -INF,
    -1,
    0,
    10**9,
    2**63,
    2**64 - 1,
    -(2**63),
    1e-300,
    [],
    [[1]],
    [[1, 2], [3]],
    [-1],
    [2**63],
    list(range(5000)),
    {},
    {"a": 1},
    "x",
    "raw",
    True,
    None,
)


@dataclass
class FuzzCase:
    """One malformed (or hostile) message.

    Attributes:
        seed, index: `fuzz_case(seed, index)` rebuilds it.
        frames: what goes on the wire (header first).
        category: which kind of damage (a key of CATEGORIES).
        message_type: the type it was built from (before damage), or None.
        target: the field it damaged ("group_id", "sampling.top_p", "tensors[0].name", "protocol", "type", "header",
            "frames", ...).
        description: what was put there, abridged.
        header_decodable: frame 0 is a msgpack map (the worker can read the header at all).
        expect: "error" when the codec refuses it, it is one of the worker's own reply types, or it carries data
            frames it takes none of; "reply" for a request the codec accepts (answered by an error or its reply).
        intended_malformed: the generator meant it to be refused by the codec (missing required field, wrong
            protocol, unknown field, ...); a case with this set and expect "reply" is one the codec lets through.
        group_id: of a generate the codec accepts (its group_result answers it), else None.
        cancels: of a cancel the codec accepts, the group id: when an accepted generate of that id is in flight on
            the same client, the cancel is answered by that group's (aborted) result.
    """

    seed: int
    index: int
    frames: list[bytes] = field(repr=False)
    category: str
    message_type: str | None
    target: str
    description: str
    header_decodable: bool = False
    expect: str = "error"
    intended_malformed: bool = True
    group_id: str | None = None
    cancels: str | None = None  # of a cancel the codec accepts: the group (answered by that group's result)
    nonce: int | None = None  # of a ping the codec accepts
    max_items: int = 1_000_000

    @property
    def nbytes(self) -> int:
        return sum(len(frame) for frame in self.frames)

    def repro(self, limit: int = 4096) -> str:
        """Python that rebuilds the exact frames: a bytes literal when short, else `fuzz_case(seed, index)`."""
        limit_arg = "" if self.max_items == OVERSIZED_ITEMS[-1] else f", max_items={self.max_items}"
        exact = (
            "from rollout.benchmarks.fuzz import fuzz_case\n"
            f"frames = fuzz_case({self.seed}, {self.index}{limit_arg}).frames"
        )
        if self.nbytes > limit:
            return f"{exact}  # {self.category} {self.target}: {self.description} ({self.nbytes} bytes)"
        return f"frames = {self.frames!r}  # {self.category} {self.target}: {self.description}"

    def summary(self) -> dict[str, Any]:
        """A JSON-able description (no frames)."""
        return {
            "index": self.index,
            "category": self.category,
            "type": self.message_type,
            "target": self.target,
            "value": self.description,
            "bytes": self.nbytes,
            "expect": self.expect,
        }


# ---- generation --------------------------------------------------------------------------------------------------
def fuzz_cases(count: int, seed: int = 0, max_items: int = OVERSIZED_ITEMS[-1]) -> Iterator[FuzzCase]:
    """`count` cases, deterministic for `seed` (case i does not depend on `count`).

    Args:
        count: how many.
        seed: which sequence.
        max_items: the largest oversized value (items of a list or map, characters of a string); oversized cases
            draw their size from OVERSIZED_ITEMS up to this (10**6 by default: cases of 1-2 MB; the worker's codec
            may take seconds on them).
    """
    for index in range(count):
        yield fuzz_case(seed, index, max_items)


def fuzz_messages(count: int, seed: int = 0, max_items: int = OVERSIZED_ITEMS[-1]) -> Iterator[list[bytes]]:
    """The frames of `fuzz_cases(count, seed, max_items)`."""
    for case in fuzz_cases(count, seed, max_items):
        yield case.frames


def fuzz_case(seed: int, index: int, max_items: int = OVERSIZED_ITEMS[-1]) -> FuzzCase:
    """Case `index` of `seed`, rebuilt (without building the cases before it)."""
    targets = _targets()
    rng = random.Random(f"{seed}/{index}")  # one generator per case: case i is independent of the others
    # Cases 4k and 4k+1 put a wrong-typed and a hostile value into (type, field) pair k (mod their number), so
    # every pair gets both within 4 * len(all_targets()) cases (about 620); the others draw a category and a pair.
    if index % 4 < 2:
        category = ("wrong_type", "hostile_value")[index % 4]
        target = targets[(index // 4) % len(targets)]
    else:
        category = rng.choices(list(CATEGORIES), list(CATEGORIES.values()))[0]
        target = rng.choice(targets)
    return _build_case(seed, index, category, rng, target, max_items)


def all_targets() -> list[tuple[str, str]]:
    """Every (message type, field path) the field-level categories cycle through."""
    return list(_targets())


@functools.cache
def _targets() -> tuple[tuple[str, str], ...]:
    targets = []
    for kind in p.MESSAGE_TYPES:
        paths = [path for path, _ in _field_paths(p.MESSAGE_TYPES[kind])]
        # A type without fields (hello, stats) gets its values in a field it does not have.
        targets += [(kind, path) for path in paths or [EXTRA_FIELD]]
        if kind == "generate":
            targets += [(kind, f"sampling.{name}") for name in _sampling_fields()]
        if kind == "weights_begin":
            targets += [(kind, f"dist.{name}") for name in ("host", "port", "world_size", "rank", "backend", "group")]
    # Requests twice as often as the worker's reply types.
    requests = [t for t in targets if t[0] in p.REQUEST_TYPES]
    return tuple(requests + targets)


def _sampling_fields() -> list[str]:
    from rollout.config import SamplingParams

    return [item.name for item in dataclasses.fields(SamplingParams)]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _field_paths(cls: type, prefix: str = "") -> tuple[tuple[str, Any], ...]:
    """(path, annotation) of every field of a message or nested dataclass, nested ones as "name[0].sub"."""
    hints = _hints(cls)
    paths = []
    for item in dataclasses.fields(cls):
        annotation = hints[item.name]
        paths.append((f"{prefix}{item.name}", annotation))
        inner = _list_of_dataclass(annotation)
        if inner is not None:
            paths += _field_paths(inner, f"{prefix}{item.name}[0].")
    return tuple(paths)


def _list_of_dataclass(annotation: Any) -> type | None:
    if typing.get_origin(annotation) is list:
        (arg,) = typing.get_args(annotation)
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _annotation_at(kind: str, path: str) -> Any:
    if path.startswith(("sampling.", "dist.")):
        return Any
    return dict(_field_paths(p.MESSAGE_TYPES[kind])).get(path, Any)


_STRING_DEFAULTS = {
    "mode": "keep",
    "transport": "frames",
    "state": "staging",
    "finish_reason": "length",
    "code": "bad_request",
    "dtype": "float32",
    "name": UNKNOWN_TENSOR,
    "model": "tiny",
    "message": "fuzz",
}


def _sample(annotation: Any, name: str) -> Any:
    """A valid value of a field, from its annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return _sample(next(a for a in args if a is not type(None)), name)
    if dataclasses.is_dataclass(annotation):
        hints = _hints(annotation)
        return {item.name: _sample(hints[item.name], item.name) for item in dataclasses.fields(annotation)}
    if origin is list:
        if args[0] is int:
            return [5, 6, 7]
        if args[0] is float:
            return [-0.5]
        return [_sample(args[0], name)]
    if origin is dict:
        return {}
    if annotation is float:
        return 1.0
    if annotation is bool:
        return False
    if annotation is int:
        return 0 if name in ("index", "offset", "version", "policy_version", "sample_index") else 4
    if annotation is str:
        return _STRING_DEFAULTS.get(name, "fz")
    return 0


def _baseline(kind: str, seed: int, index: int) -> tuple[dict[str, Any], list[bytes]]:
    """A valid header of `kind` (and its data frames): what the damage is applied to. A generate is cheap (greedy,
    2 tokens); a weights_begin names an unknown tensor, so it can never open an update."""
    cls = p.MESSAGE_TYPES[kind]
    hints = _hints(cls)
    header: dict[str, Any] = {"protocol": p.PROTOCOL_VERSION, "type": kind}
    for item in dataclasses.fields(cls):
        if item.default is None:
            continue  # an optional nil: left out
        header[item.name] = _sample(hints[item.name], item.name)
    if "group_id" in header:
        header["group_id"] = f"fz{seed}-{index}"
    if "update_id" in header:
        header["update_id"] = f"fz{seed}-u{index}"
    data: list[bytes] = []
    if kind == "generate":
        header["n"] = 1
        header["sampling"] = {"max_new_tokens": 2, "do_sample": False, "stop_token_ids": []}
    elif kind == "weights_bucket":
        header["pieces"] = [{"index": 0, "offset": 0, "nbytes": 4}]
        data = [b"\x00" * 4]
    elif kind == "ping":
        header["nonce"] = index
    return header, data


def _set_path(header: dict[str, Any], path: str, value: Any, delete: bool = False) -> None:
    """Put `value` at a field path ("a", "a.b", "a[0].b") of the header, creating what is missing."""
    node: Any = header
    parts = path.replace("[0]", ".[0]").split(".")
    for position, part in enumerate(parts[:-1]):
        if part == "[0]":
            if not node or not isinstance(node[0], dict):
                node[:] = [{}]
            node = node[0]
        else:
            container = list if parts[position + 1] == "[0]" else dict
            if not isinstance(node.get(part), container):
                node[part] = container()
            node = node[part]
    last = parts[-1]
    if not isinstance(node, dict):
        return
    if delete:
        node.pop(last, None)
    else:
        node[last] = value


def _pick_type(rng: random.Random) -> str:
    """A request three times in four, else one of the worker's own reply types."""
    return rng.choice(REQUEST_TYPES) if rng.random() < 0.75 else rng.choice(WORKER_TYPES)


def _hostile(rng: random.Random, kind: str, path: str) -> Any:
    name = path.rsplit(".", 1)[-1]
    if path.startswith("sampling."):
        return rng.choice(HOSTILE_SAMPLING)
    if name in HOSTILE_BY_NAME and rng.random() < 0.7:
        return rng.choice(HOSTILE_BY_NAME[name])
    annotation = _annotation_at(kind, path)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        annotation = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is str:
        return rng.choice(HOSTILE_STRINGS)
    if annotation is int:
        return rng.choice(HOSTILE_INTS)
    if annotation is float:
        return rng.choice(HOSTILE_FLOATS)
    if annotation is bool:
        return rng.choice((0, 1, None))
    if origin is list:
        if args[0] is float:
            return rng.choice(([NAN], [INF, -INF], [], ["x"], [1e308] * 100))
        if typing.get_origin(args[0]) is list:
            return rng.choice(([[]], [[1]], [[1, 2, 3]], [["a", 1]], [[-1, -1]], [[2**64 - 1, 0]]))
        if dataclasses.is_dataclass(args[0]):
            return rng.choice(([], [{}], [None], [[]], [{"unknown": 1}], [_sample(args[0], name)] * 1000))
        return rng.choice(HOSTILE_INT_LISTS)
    if origin is dict:
        return rng.choice(({}, {"": 1}, {"a": {"b": {}}}, {b"bytes-key": 1}, {f"k{i}": i for i in range(1000)}))
    return rng.choice(WRONG_TYPE_VALUES)


def _oversized(rng: random.Random, annotation: Any, max_items: int) -> tuple[Any, str]:
    size = rng.choice(OVERSIZED_ITEMS[:2]) if rng.random() < 0.75 else OVERSIZED_ITEMS[2]
    size = min(size, max_items)
    origin = typing.get_origin(annotation)
    shape = rng.choice(("str", "int_list", "str_list", "map")) if annotation is Any else None
    if annotation is str or shape == "str":
        return "a" * size, f"a string of {size} characters"
    if origin is dict or shape == "map":
        size //= 10
        return {f"k{i}": i for i in range(size)}, f"a map of {size} entries"
    inner = typing.get_args(annotation)[0] if origin is list else None
    if dataclasses.is_dataclass(inner) and rng.random() < 0.5:
        # Valid items: the codec has to build every one before anything else can refuse the message (2 MB at most).
        item = _sample(inner, "")
        size = min(size // 10, (2 << 20) // len(msgpack.packb(item)))
        return [item] * size, f"a list of {size} valid {inner.__name__} maps"
    if shape == "str_list" or dataclasses.is_dataclass(inner):
        return ["x"] * size, f"a list of {size} strings"
    return [1] * size, f"a list of {size} small ints"


_LIST1 = b"\x91"  # msgpack: an array of one item


class _Splice:
    """A placeholder in a header whose packed bytes are replaced by raw msgpack bytes after packing (for values
    msgpack-python will not pack: nesting past its limit, invalid UTF-8)."""

    def __init__(self, raw: bytes, token: str):
        self.raw = raw
        self.token = token


def _pack(header: Any, splice: _Splice | None = None) -> bytes:
    """msgpack bytes of a header; `splice`, placed somewhere in it, is packed as its token, then swapped."""
    if splice is None:
        return msgpack.packb(header, use_bin_type=True)

    def swap(value: Any) -> Any:
        if value is splice:
            return splice.token
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        return value

    data = msgpack.packb(swap(header), use_bin_type=True)
    return data.replace(msgpack.packb(splice.token), splice.raw, 1)


def _nested(rng: random.Random, depth: int, token: str) -> _Splice:
    """A value nested `depth` levels deep (lists or single-entry maps), ending in nil."""
    level = _LIST1 if rng.random() < 0.6 else b"\x81" + msgpack.packb("k")
    return _Splice(level * depth + b"\xc0", token)


def _abridged_value(value: Any) -> str:
    if isinstance(value, (list, dict, str, bytes)) and len(value) > 8:
        return f"{type(value).__name__} of {len(value)} items, starting {_short(value)}"
    return _short(value)


def _short(value: Any) -> str:
    if isinstance(value, list):
        text = repr(value[:3])
    elif isinstance(value, dict):
        text = repr(dict(list(value.items())[:3]))
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _build_case(
    seed: int, index: int, category: str, rng: random.Random, target: tuple[str, str], max_items: int
) -> FuzzCase:
    kind, path = target
    token = f"\x00splice{seed}/{index}\x00"
    data: list[bytes] = []
    description = ""
    intended = True
    header: Any
    if category in ("wrong_type", "hostile_value", "missing_field", "nested", "invalid_utf8", "oversized"):
        header, data = _baseline(kind, seed, index)
        if category == "wrong_type":
            value = rng.choice(WRONG_TYPE_VALUES)
            intended = path == EXTRA_FIELD or not _fits(value, _annotation_at(kind, path))
        elif category == "hostile_value":
            value = _hostile(rng, kind, path)
            intended = path == EXTRA_FIELD
        elif category == "missing_field":
            value = None
            intended = _required(kind, path)
        elif category == "nested":
            depth = rng.choice(NESTING_DEPTHS)
            value = _nested(rng, depth, token)
            path = rng.choice((path, "type", "protocol", "group_id", "prompt_ids", "sampling.stop_token_ids"))
            shape = [] if value.raw.startswith(_LIST1) else {}
            description = f"nil nested in {depth} {'lists' if shape == [] else 'maps'}"
            intended = path in ("type", "protocol") or not _fits(shape, _annotation_at(kind, path))
        elif category == "invalid_utf8":
            raw = rng.choice((b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"abc\x80"))
            value = _Splice(bytes([0xA0 | len(raw)]) + raw, token)
            description = f"invalid UTF-8 string {raw!r}"
            if rng.random() < 0.3:
                path = rng.choice(("type", "protocol"))
        else:  # oversized: into a string, list or map field of the type when it has one
            sized = [f for f, a in _field_paths(p.MESSAGE_TYPES[kind]) if _container(a)]
            path = rng.choice(sized) if sized else path
            value, description = _oversized(rng, _annotation_at(kind, path), max_items)
            intended = False
        if path in ("type", "protocol"):
            header[path] = value
        else:
            _set_path(header, path, value, delete=category == "missing_field")
        if not description:
            description = "deleted" if category == "missing_field" else _abridged_value(value)
        frames = [_pack(header, value if isinstance(value, _Splice) else None), *data]
    elif category == "unknown_field":
        header, data = _baseline(kind, seed, index)
        name = rng.choice(("x", "", "__class__", "TYPE", "group_id ", "Protocol", "\x00", "stream2", "nonce_"))
        if name in header:
            name += "_"
        header[name] = rng.choice(WRONG_TYPE_VALUES)
        path, description = name, _short(header[name])
        frames = [_pack(header), *data]
    elif category in ("protocol", "type"):
        header, data = _baseline(kind, seed, index)
        if category == "protocol":
            choices = (0, 2, -1, "1", 1.0, True, None, [], [1], {}, {"v": 1}, 2**64 - 1, b"\x01", "missing")
        else:
            choices = ("", "HELLO", "hello ", "nope", "__class__", "Message", 1, None, True, 1.5, b"ping", [], ["ping"])
            choices += ({}, {"a": 1}, [[1], {"k": []}], "x" * 1000, "missing")
        value = rng.choice(choices)
        if isinstance(value, str) and value == "missing":
            del header[category]
            description = "deleted"
        else:
            header[category] = value
            description = _short(value)
        path = category
        frames = [_pack(header), *data]
    elif category == "non_map":
        header, data = _baseline(kind, seed, index)
        value = rng.choice((list(header.items()), list(header.values()), 1, -1, "ping", None, True, 1.5, b"x"))
        value = rng.choice((value, msgpack.ExtType(7, msgpack.packb(header))))
        kind, path, description = None, "header", _short(value)
        frames = [msgpack.packb(value, use_bin_type=True)]
    elif category == "random_bytes":
        size = rng.choice((0, 1, 2, 7, 16, 64, 512))
        first = rng.choice((b"", b"\x80", b"\x8f", b"\xde", b"\xdf", b"\x81", b"\xc1", b"\xd9"))
        frames = [(first + rng.randbytes(size))[:size]]
        kind, path, description = None, "header", f"{len(frames[0])} random bytes"
    elif category == "truncated":
        header, data = _baseline(kind, seed, index)
        packed = _pack(header)
        cut = rng.randrange(len(packed))
        frames = [packed[:cut], *data]
        path, description = "header", f"first {cut} of {len(packed)} bytes"
    elif category == "extra_frames":
        kind = rng.choice([k for k in REQUEST_TYPES if k != "weights_bucket"] + list(WORKER_TYPES[:2]))
        header, _ = _baseline(kind, seed, index)
        extra = [rng.randbytes(rng.choice((0, 1, 16, 1024))) for _ in range(rng.choice((1, 2, 3, 50)))]
        frames = [_pack(header), *extra]
        path, description = "frames", f"{len(extra)} data frame(s) after a {kind}"
    elif category == "bucket_frames":
        kind = "weights_bucket"
        header, _ = _baseline(kind, seed, index)
        count = rng.choice((0, 2, 10, 100))
        sizes = (0, 4, 4096, 65536) if count <= 10 else (0, 4, 256)
        frames = [_pack(header), *[rng.randbytes(rng.choice(sizes)) for _ in range(count)]]
        path, description, intended = "frames", f"{count} data frames for 1 piece, no open update", False
    elif category == "bad_keys":
        header, data = _baseline(kind, seed, index)
        style = rng.choice(("int_key", "bytes_key", "duplicate", "float_key", "nil_key", "nested_int_key"))
        if style == "duplicate":
            body = b"".join(msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in header.items())
            other = rng.choice([t for t in p.MESSAGE_TYPES if t != kind])
            body += msgpack.packb("type") + msgpack.packb(other)
            frames = [_map_header(len(header) + 1) + body, *data]
            description = f"a second 'type' key: {other!r}"
        else:
            key = {"int_key": 1, "bytes_key": b"type", "float_key": 1.5, "nil_key": None, "nested_int_key": None}[style]
            if style == "nested_int_key":
                header["sampling" if "sampling" in header else "config"] = {7: 1}
            else:
                header[key] = 1
            frames = [msgpack.packb(header, use_bin_type=True), *data]
            description = style
        path = "header"
    else:  # valid
        kind = rng.choice(("hello", "ping", "stats", "weights_spec", "generate", "cancel", "weights_abort"))
        header, data = _baseline(kind, seed, index)
        frames = [_pack(header), *data]
        path, description, intended = "-", "a valid request", False
    case = FuzzCase(seed, index, frames, category, kind, path, description, intended_malformed=intended)
    case.max_items = max_items
    _classify(case)
    return case


def _required(kind: str, path: str) -> bool:
    if path.startswith(("sampling.", "dist.")):
        return False
    cls = p.MESSAGE_TYPES[kind]
    if "[0]." in path:
        outer, inner = path.split("[0].", 1)
        cls = _list_of_dataclass(_hints(cls)[outer])
        path = inner
    item = {f.name: f for f in dataclasses.fields(cls)}.get(path)
    return item is not None and item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING


def _container(annotation: Any) -> bool:
    """A str, list or dict field (possibly optional)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return any(_container(a) for a in args if a is not type(None))
    return annotation is str or origin in (list, dict)


def _fits(value: Any, annotation: Any) -> bool:
    """Whether `value` has the type a field of `annotation` takes (at the top level; what the codec should take)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return True
    if origin in (Union, types.UnionType):
        return (value is None and type(None) in args) or any(_fits(value, a) for a in args if a is not type(None))
    if dataclasses.is_dataclass(annotation) or origin is dict:
        return isinstance(value, dict)
    if origin is list:
        return isinstance(value, list)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return type(value) is annotation


def _map_header(size: int) -> bytes:
    return bytes([0x80 | size]) if size < 16 else b"\xde" + size.to_bytes(2, "big")


# Cases whose header frame is larger than this are not decoded here (the codec may take seconds on them): they only
# need some reply.
_LOCAL_DECODE_LIMIT = 64 << 10


def _classify(case: FuzzCase) -> None:
    """Whether the header is a readable msgpack map, and what answer the worker owes (from the real codec)."""
    try:
        header = msgpack.unpackb(case.frames[0], raw=False, strict_map_key=True)
        case.header_decodable = isinstance(header, dict)
    except Exception:  # noqa: BLE001 - undecodable on purpose
        case.header_decodable = False
    if len(case.frames[0]) > _LOCAL_DECODE_LIMIT:
        case.expect = "reply"
        if case.header_decodable and header.get("type") == "generate" and isinstance(header.get("group_id"), str):
            case.group_id = header["group_id"]  # the worker may accept it: then its group_result answers it
        return
    try:
        message = p.decode(case.frames)
    except Exception:  # noqa: BLE001 - ProtocolError, or whatever else the codec trips on: the worker owes an error
        case.expect = "error"
        return
    if message.TYPE not in p.REQUEST_TYPES or (len(case.frames) > 1 and not isinstance(message, p.WeightsBucket)):
        case.expect = "error"
        return
    case.expect = "reply"
    if isinstance(message, p.Generate):
        case.group_id = message.group_id
    elif isinstance(message, p.Cancel):
        case.cancels = message.group_id
    elif isinstance(message, p.Ping):
        case.nonce = message.nonce


# ---- sending ------------------------------------------------------------------------------------------------------
@dataclass
class FuzzReport:
    """What `send_fuzz` saw. Every case is owed a reply (an error, or the answer to a request the codec accepts)."""

    address: str
    seed: int
    sent: int = 0
    bytes_sent: int = 0
    answered: int = 0  # cases that got at least one reply
    error_replies: int = 0  # cases answered by an error
    other_replies: int = 0  # cases answered by something else (pong, hello_reply, group_result, ...)
    unanswered: int = 0
    stray_replies: int = 0  # results that came after their case was concluded unanswered
    unsolicited_pongs: int = 0  # pongs that answer no case (the worker's liveness probes)
    header_decodable: int = 0  # cases whose header is a msgpack map
    header_decodable_errors: int = 0  # of those, answered by an error
    expected_error: int = 0  # cases the codec refuses (or reply types, or stray frames): an error is owed
    expected_error_answered_ok: int = 0  # of those, answered by something other than an error
    decodable_owed_error: int = 0  # cases with a readable header that the codec refuses
    decodable_owed_error_answered: int = 0  # of those, answered by an error
    accepted_requests: int = 0  # cases the codec accepts (valid, or valid but hostile)
    lenient: int = 0  # cases meant to be malformed that the codec accepts
    identities: int = 0
    seconds: float = 0.0
    send_seconds: float = 0.0  # until every case was past its sentinel (then: waiting for accepted generates)
    max_latency_s: float = 0.0
    worker_stopped: bool = False  # the worker stopped answering (died or stalled past every wait)
    stalls: int = 0  # waits that ended without a reply while cases were in flight
    by_category: dict[str, dict[str, int]] = field(default_factory=dict)
    error_codes: dict[str, int] = field(default_factory=dict)
    unanswered_cases: list[FuzzCase] = field(default_factory=list)
    wrong_answer_cases: list[FuzzCase] = field(default_factory=list)  # an error was owed, something else came
    lenient_cases: list[FuzzCase] = field(default_factory=list)
    # Answered by code "internal": an exception the worker did not anticipate (should be a "bad_request").
    internal_cases: list[tuple[FuzzCase, str]] = field(default_factory=list)
    slow_cases: list[tuple[float, FuzzCase]] = field(default_factory=list)  # (seconds, case), slowest first
    suspects: list[FuzzCase] = field(default_factory=list)  # in flight when the worker stopped answering
    serving: dict[str, Any] = field(default_factory=dict)  # check_serving() after the fuzz

    def to_dict(self, cases: int = 5) -> dict[str, Any]:
        """JSON-able figures, with the first `cases` cases of each list (summaries and repros)."""

        def listed(items: list[FuzzCase]) -> list[dict[str, Any]]:
            return [{**c.summary(), "repro": c.repro(512)} for c in items[:cases]]

        return {
            "address": self.address,
            "seed": self.seed,
            "sent": self.sent,
            "bytes_sent": self.bytes_sent,
            "answered": self.answered,
            "error_replies": self.error_replies,
            "other_replies": self.other_replies,
            "unanswered": self.unanswered,
            "stray_replies": self.stray_replies,
            "unsolicited_pongs": self.unsolicited_pongs,
            "header_decodable": self.header_decodable,
            "header_decodable_errors": self.header_decodable_errors,
            "expected_error": self.expected_error,
            "expected_error_answered_ok": self.expected_error_answered_ok,
            "decodable_owed_error": self.decodable_owed_error,
            "decodable_owed_error_answered": self.decodable_owed_error_answered,
            "accepted_requests": self.accepted_requests,
            "lenient": self.lenient,
            "identities": self.identities,
            "seconds": round(self.seconds, 2),
            "send_seconds": round(self.send_seconds, 2),
            "max_latency_s": round(self.max_latency_s, 3),
            "stalls": self.stalls,
            "worker_stopped": self.worker_stopped,
            "error_codes": self.error_codes,
            "by_category": self.by_category,
            "unanswered_cases": listed(self.unanswered_cases),
            "wrong_answer_cases": listed(self.wrong_answer_cases),
            "lenient_cases": listed(self.lenient_cases),
            "internal_cases": [
                {**c.summary(), "message": message, "repro": c.repro(512)} for c, message in self.internal_cases[:cases]
            ],
            "slow_cases": [{"seconds": round(s, 3), **c.summary()} for s, c in self.slow_cases[:cases]],
            "suspects": listed(self.suspects),
            "serving": self.serving,
        }


@dataclass
class _Tracked:
    case: FuzzCase
    sent_at: float
    sentinel: int  # the nonce of the ping sent after it
    replies: list[p.Message] = field(default_factory=list)
    done_at: float | None = None


class _Socket:
    """One DEALER socket (one client identity as the worker sees it) and the cases in flight on it."""

    def __init__(self, context: zmq.Context, address: str):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.connect(address)
        self.pending: deque[_Tracked] = deque()  # sent, sentinel pong not yet back
        self.retired_at = 0.0
        self.deferred: dict[str, deque[_Tracked]] = {}  # group id -> accepted generates awaiting their result
        self.cancelling: dict[str, list[_Tracked]] = {}  # group id -> cancels answered by that group's result

    def close(self) -> None:
        self.socket.close(linger=0)


def send_fuzz(
    address: str,
    count: int,
    seed: int = 0,
    *,
    rotate_every: int = 100,
    window: int = 32,
    reply_timeout_s: float = 10.0,
    deferred_timeout_s: float = 60.0,
    slow_s: float = 1.0,
    check: bool = True,
    alive: Callable[[], bool] | None = None,
    stop: Callable[[], bool] | None = None,
    cases: Iterable[FuzzCase] | None = None,
    max_items: int = OVERSIZED_ITEMS[-1],
    report: FuzzReport | None = None,
) -> FuzzReport:
    """Send `count` fuzz cases of `seed` to the worker at `address` and account for every reply.

    Args:
        address: the worker's ZeroMQ address.
        count, seed: which cases (`fuzz_cases(count, seed)`, unless `cases` is given).
        rotate_every: cases per socket (a fresh client identity each time).
        window: most cases in flight (sent, their sentinel pong not back).
        reply_timeout_s: a wait this long without any reply while cases are in flight is a stall: the worker is
            probed; one that does not answer a fresh ping ends the run (`worker_stopped`).
        deferred_timeout_s: how long accepted generates may take to return their group_result.
        slow_s: cases the worker took longer than this to get past are listed in `slow_cases`.
        check: after the fuzz, `check_serving` (hello, a greedy generate, the weight-update slot).
        alive: optional liveness test of the worker (e.g. its process is running), checked on stalls.
        stop: optional; when it returns True, sending stops early (what was sent is still accounted for).
        cases: optional cases to send instead of `fuzz_cases(count, seed, max_items)`.
        max_items: the largest oversized value (see `fuzz_cases`).
        report: optional FuzzReport to fill (its counts are live while this runs, e.g. for another thread).
    """
    report = report if report is not None else FuzzReport(address, seed)
    context = zmq.Context()
    start = time.monotonic()
    latencies: list[tuple[float, FuzzCase]] = []
    current: _Socket | None = None
    retired: list[_Socket] = []  # earlier sockets still awaiting group_results of accepted generates
    sentinel = itertools.count()
    try:
        for case in cases if cases is not None else fuzz_cases(count, seed, max_items):
            if stop is not None and stop():
                break
            if current is None or report.sent % rotate_every == 0:
                if current is not None:
                    _drain_pending(current, report, latencies, reply_timeout_s, context, alive)
                    current.retired_at = time.monotonic()
                    retired.append(current)
                if report.worker_stopped:
                    break
                current = _Socket(context, address)
                report.identities += 1
            retired = _poll_retired(retired, report, latencies, deferred_timeout_s, 0.0)
            nonce = SENTINEL_BASE + next(sentinel)
            current.socket.send_multipart(case.frames)
            current.socket.send_multipart(p.encode(p.Ping(nonce)))
            current.pending.append(_Tracked(case, time.monotonic(), nonce))
            report.sent += 1
            report.bytes_sent += case.nbytes
            _receive(current, report, latencies, 0)
            while len(current.pending) >= window and not report.worker_stopped:
                if not _receive(current, report, latencies, reply_timeout_s):
                    _stalled(current, report, address, context, alive)
            if report.worker_stopped:
                break
        if current is not None:
            _drain_pending(current, report, latencies, reply_timeout_s, context, alive)
            current.retired_at = time.monotonic()
            retired.append(current)
        report.send_seconds = time.monotonic() - start
        while retired and not report.worker_stopped:
            retired = _poll_retired(retired, report, latencies, deferred_timeout_s, 0.2)
        for sock in retired:  # the worker stopped: what it still owed is unanswered
            _conclude_deferred(sock, report)
    finally:
        context.destroy(linger=0)
    report.seconds = time.monotonic() - start
    latencies.sort(key=lambda item: -item[0])
    report.max_latency_s = latencies[0][0] if latencies else 0.0
    report.slow_cases = [item for item in latencies if item[0] > slow_s]
    if check and not report.worker_stopped:
        report.serving = check_serving(address)
    return report


def _receive(sock: _Socket, report: FuzzReport, latencies: list, timeout_s: float) -> bool:
    """Take every reply waiting (waiting up to `timeout_s` for the first); False when none came."""
    got = False
    while sock.socket.poll(int(timeout_s * 1000) if not got else 0):
        got = True
        frames = sock.socket.recv_multipart()
        try:
            message = p.decode(frames)
        except p.ProtocolError:
            message = p.Error("undecodable_reply", repr(frames[:1])[:200])
        _attribute(sock, message, report, latencies)
    return got


def _attribute(sock: _Socket, message: p.Message, report: FuzzReport, latencies: list) -> None:
    if isinstance(message, p.Pong) and any(t.sentinel == message.nonce for t in sock.pending):
        # Everything the worker will say about a case came before its sentinel pong (answers to accepted generates
        # excepted). Cases before it whose pong never came are concluded with it.
        while sock.pending:
            tracked = sock.pending.popleft()
            tracked.done_at = time.monotonic()
            latencies.append((tracked.done_at - tracked.sent_at, tracked.case))
            if not tracked.replies and tracked.case.group_id is not None:
                sock.deferred.setdefault(tracked.case.group_id, deque()).append(tracked)
            elif not tracked.replies and tracked.case.cancels in sock.deferred:
                sock.cancelling.setdefault(tracked.case.cancels, []).append(tracked)
            else:
                _conclude(tracked, report)
            if tracked.sentinel == message.nonce:
                return
        return
    group_id = getattr(message, "group_id", None)
    if isinstance(message, (p.GroupResult, p.Delta)) and group_id in sock.deferred:
        waiting = sock.deferred[group_id]
        tracked = waiting[0]
        tracked.replies.append(message)
        if isinstance(message, p.GroupResult):
            waiting.popleft()
            if not waiting:
                del sock.deferred[group_id]
            _conclude(tracked, report)
            for cancel in sock.cancelling.pop(group_id, []):
                cancel.replies.append(message)
                _conclude(cancel, report)
        return
    if isinstance(message, (p.GroupResult, p.Delta)):
        # An accepted generate whose answer came before its sentinel pong (or a stream's deltas): its case.
        for tracked in sock.pending:
            if tracked.case.group_id == group_id:
                tracked.replies.append(message)
                return
        report.stray_replies += 1  # the answer to a case already concluded (it came after every wait)
        return
    if isinstance(message, p.Pong) and not (sock.pending and sock.pending[0].case.nonce == message.nonce):
        # Not the answer to the case in flight: the worker probes clients with unsolicited pongs (nonce -1) when a
        # connection closes (e.g. after this sender replaced its socket).
        report.unsolicited_pongs += 1
        return
    if sock.pending:
        sock.pending[0].replies.append(message)


def _conclude(tracked: _Tracked, report: FuzzReport) -> None:
    case = tracked.case
    stats = report.by_category.setdefault(case.category, {"sent": 0, "answered": 0, "errors": 0, "unanswered": 0})
    stats["sent"] += 1
    report.header_decodable += case.header_decodable
    if case.expect == "error":
        report.expected_error += 1
        report.decodable_owed_error += case.header_decodable
    else:
        report.accepted_requests += 1
        if case.intended_malformed:
            report.lenient += 1
            report.lenient_cases.append(case)
    replies = [r for r in tracked.replies if not isinstance(r, p.Delta)] or tracked.replies
    if not replies:
        report.unanswered += 1
        stats["unanswered"] += 1
        report.unanswered_cases.append(case)
        return
    report.answered += 1
    stats["answered"] += 1
    first = replies[0]
    if isinstance(first, p.Error):
        report.error_replies += 1
        stats["errors"] += 1
        report.header_decodable_errors += case.header_decodable
        if case.expect == "error":
            report.decodable_owed_error_answered += case.header_decodable
        report.error_codes[first.code] = report.error_codes.get(first.code, 0) + 1
        if first.code == "internal":
            report.internal_cases.append((case, first.message[:200]))
    else:
        report.other_replies += 1
        if case.expect == "error":
            report.expected_error_answered_ok += 1
            report.wrong_answer_cases.append(case)


def _stalled(
    sock: _Socket, report: FuzzReport, address: str, context: zmq.Context, alive: Callable[[], bool] | None
) -> None:
    """No reply within the wait while cases are in flight: is the worker still there?"""
    report.stalls += 1
    if (alive is None or alive()) and _pings(context, address, 5.0):
        # Alive but these cases were never answered: give up on them (a later sentinel pong closes them anyway).
        while sock.pending:
            _conclude(sock.pending.popleft(), report)
        return
    report.worker_stopped = True
    report.suspects = [tracked.case for tracked in sock.pending]
    while sock.pending:
        _conclude(sock.pending.popleft(), report)


def _drain_pending(
    sock: _Socket,
    report: FuzzReport,
    latencies: list,
    reply_timeout_s: float,
    context: zmq.Context,
    alive: Callable[[], bool] | None,
) -> None:
    """Wait (bounded) until every case sent on this socket is past its sentinel pong."""
    while sock.pending and not report.worker_stopped:
        if not _receive(sock, report, latencies, reply_timeout_s):
            _stalled(sock, report, report.address, context, alive)


def _poll_retired(
    retired: list[_Socket], report: FuzzReport, latencies: list, deferred_timeout_s: float, wait_s: float
) -> list[_Socket]:
    """Take the group_results that came to earlier sockets; close those that owe nothing more (or waited past
    `deferred_timeout_s`: what they still owed is unanswered). Returns the ones still open."""
    still = []
    for sock in retired:
        if sock.deferred:
            _receive(sock, report, latencies, wait_s / max(1, len(retired)))
        if sock.deferred and time.monotonic() - sock.retired_at < deferred_timeout_s:
            still.append(sock)
            continue
        _conclude_deferred(sock, report)
        sock.close()
    return still


def _conclude_deferred(sock: _Socket, report: FuzzReport) -> None:
    for waiting in [*sock.deferred.values(), *sock.cancelling.values()]:
        for tracked in waiting:
            _conclude(tracked, report)
    sock.deferred.clear()
    sock.cancelling.clear()


def _pings(context: zmq.Context, address: str, timeout_s: float) -> bool:
    probe = context.socket(zmq.DEALER)
    probe.setsockopt(zmq.LINGER, 0)
    probe.connect(address)
    try:
        probe.send_multipart(p.encode(p.Ping(1)))
        return bool(probe.poll(int(timeout_s * 1000)))
    finally:
        probe.close()


# ---- does the worker still serve? --------------------------------------------------------------------------------
GREEDY_PROMPT = [7, 8, 9, 10, 11]
GREEDY_SAMPLING = {"do_sample": False, "max_new_tokens": 8, "stop_token_ids": []}


def check_serving(address: str, timeout_s: float = 60.0, update_slot: bool = True) -> dict[str, Any]:
    """A raw `hello`, a greedy generate through `RolloutClient`, and (optionally) whether a weight update can still
    be opened (begin with one real tensor, then abort). Never raises: failures are reported.

    Returns:
        {"hello": bool, "model": str, "greedy_tokens": [int] or None, "generate_error": str or None,
         "update_slot_free": bool or None, "update_slot_error": str or None, "seconds": float}.
    """
    from trainer_bridge import PromptGroup, RolloutClient, RolloutError

    start = time.monotonic()
    out: dict[str, Any] = {"hello": False, "model": None, "greedy_tokens": None, "generate_error": None}
    context = zmq.Context()
    try:
        reply = _ask(context, address, [p.encode(p.Hello())[0]], min(timeout_s, 15.0))
        if isinstance(reply, p.HelloReply):
            out.update(hello=True, model=reply.model)
        try:
            with RolloutClient(address, timeout=timeout_s) as client:
                result = client.generate(PromptGroup(list(GREEDY_PROMPT), 1, dict(GREEDY_SAMPLING)))
                out["greedy_tokens"] = list(result.completions[0].token_ids)
        except (RolloutError, OSError, ValueError) as error:
            out["generate_error"] = f"{type(error).__name__}: {error}"
        if update_slot:
            out.update(_update_slot(context, address, min(timeout_s, 15.0)))
    finally:
        context.destroy(linger=0)
    out["seconds"] = round(time.monotonic() - start, 2)
    return out


def _update_slot(context: zmq.Context, address: str, timeout_s: float) -> dict[str, Any]:
    """Open an update of one real tensor and abort it at once: is the slot free?"""
    update_id = f"fuzz-slot-check-{time.monotonic_ns()}"
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        spec = _request(sock, p.WeightsSpec(update_id), timeout_s)
        if not isinstance(spec, p.WeightsSpecReply) or not spec.tensors:
            return {"update_slot_free": None, "update_slot_error": f"weights_spec answered {spec!r:.200}"}
        smallest = min(spec.tensors, key=lambda t: math.prod(t.shape))
        begin = p.WeightsBegin(update_id, [smallest], partial=True, timeout_s=10.0)
        ready = _request(sock, begin, timeout_s)
        if not isinstance(ready, p.WeightsReady):
            return {"update_slot_free": False, "update_slot_error": f"weights_begin answered {ready!r:.300}"}
        _request(sock, p.WeightsAbort(update_id), timeout_s)
        return {"update_slot_free": True, "update_slot_error": None}
    finally:
        sock.close(linger=0)


def _request(sock: zmq.Socket, message: p.Message, timeout_s: float) -> p.Message | None:
    sock.send_multipart(p.encode(message))
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return p.decode(sock.recv_multipart())


def _ask(context: zmq.Context, address: str, frames: list[bytes], timeout_s: float) -> p.Message | None:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return p.decode(sock.recv_multipart())
    finally:
        sock.close(linger=0)


def format_report(report: FuzzReport) -> str:
    """A few lines for a terminal."""
    lines = [
        f"fuzz {report.address}, seed {report.seed}: {report.sent} messages ({report.bytes_sent / 1e6:.1f} MB) from "
        f"{report.identities} identities in {report.seconds:.1f} s",
        f"  answered {report.answered} (errors {report.error_replies}, other {report.other_replies}), "
        f"unanswered {report.unanswered}; decodable headers {report.header_decodable}, answered by an error "
        f"{report.header_decodable_errors}",
        f"  an error owed {report.expected_error} (readable header {report.decodable_owed_error}, answered by an error "
        f"{report.decodable_owed_error_answered}), something else came {report.expected_error_answered_ok}; accepted "
        f"by the codec {report.accepted_requests} (of which meant malformed {report.lenient})",
        f"  slowest {report.max_latency_s:.2f} s, {len(report.slow_cases)} slow, {report.stalls} stalls, worker "
        f"{'STOPPED ANSWERING' if report.worker_stopped else 'still answering'}",
    ]
    if report.serving:
        s = report.serving
        lines.append(
            f"  after: hello {'ok' if s.get('hello') else 'FAILED'}, greedy generate "
            f"{'ok' if s.get('greedy_tokens') else 'FAILED: ' + str(s.get('generate_error'))}, update slot "
            f"{ {True: 'free', False: 'HELD', None: 'unknown'}[s.get('update_slot_free')] }"
        )
    for title, items in (
        ("unanswered", report.unanswered_cases),
        ("an error owed, got", report.wrong_answer_cases),
        ("suspects", report.suspects),
        ("internal error", [c for c, _ in report.internal_cases]),
    ):
        for case in items[:5]:
            lines.append(
                f"  {title}: #{case.index} {case.category} {case.message_type}.{case.target} = {case.description}"
            )
    return "\n".join(lines)
