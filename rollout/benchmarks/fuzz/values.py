"""What the fuzz puts into messages: the message types it builds, the sentinel nonces, the kinds of case (and how
often each comes), wrong-typed and hostile values (per field name and per annotation), oversized values, values
nested past msgpack's depth limit, packing a header with raw msgpack bytes spliced in, and abridged descriptions."""

from __future__ import annotations

import dataclasses
import random
import types
import typing
from typing import Any, Union

import msgpack

from rollout import protocol as p
from rollout.benchmarks.fuzz.fields import UNKNOWN_TENSOR, _annotation_at, _sample

# What a client may send (requests), and the worker's own answers (sent to it, they must be refused by type).
REQUEST_TYPES = tuple(kind for kind in p.MESSAGE_TYPES if kind in p.REQUEST_TYPES)
WORKER_TYPES = tuple(kind for kind in p.MESSAGE_TYPES if kind not in p.REQUEST_TYPES)

# Sentinel pings carry nonces from here on (a pong is a sentinel only when its nonce is one in flight).
SENTINEL_BASE = 0x7E57_0000_0000_0000
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
    if typing.get_origin(annotation) in (Union, types.UnionType):  # an optional field: its non-nil type
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
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


def _map_header(size: int) -> bytes:
    return bytes([0x80 | size]) if size < 16 else b"\xde" + size.to_bytes(2, "big")
