"""The messages' fields as the fuzz sees them: every (message type, field path) target, the annotation at a path, a
valid baseline header of each type, putting a value at a field path, whether a field is required, a container, or
takes a value's type."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Union

from rollout import protocol as p

UNKNOWN_TENSOR = "fuzz.no_such_tensor"
EXTRA_FIELD = "x"  # the field values go into for message types that have none


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
