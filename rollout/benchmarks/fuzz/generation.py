"""Building the cases: `fuzz_cases(count, seed)`, `fuzz_messages`, and `fuzz_case(seed, index)`, which rebuilds any
one case from its seed and index alone."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import msgpack

from rollout import protocol as p
from rollout.benchmarks.fuzz.cases import FuzzCase, _classify
from rollout.benchmarks.fuzz.fields import (
    EXTRA_FIELD,
    _annotation_at,
    _baseline,
    _container,
    _field_paths,
    _fits,
    _required,
    _set_path,
    _targets,
)
from rollout.benchmarks.fuzz.values import (
    _LIST1,
    CATEGORIES,
    NESTING_DEPTHS,
    OVERSIZED_ITEMS,
    REQUEST_TYPES,
    WORKER_TYPES,
    WRONG_TYPE_VALUES,
    _abridged_value,
    _hostile,
    _map_header,
    _nested,
    _oversized,
    _pack,
    _short,
    _Splice,
)


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


def _pick_type(rng: random.Random) -> str:
    """A request three times in four, else one of the worker's own reply types."""
    return rng.choice(REQUEST_TYPES) if rng.random() < 0.75 else rng.choice(WORKER_TYPES)


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
