"""The wire protocol's codec: a message dataclass to ZeroMQ frames and back. Decoding is bounded before it builds
anything (header bytes, items per list, string lengths, containers, named list lengths) and checks every field's
presence and type; whatever is wrong raises `ProtocolError` naming the field."""

from __future__ import annotations

import dataclasses
import functools
import reprlib
import types
import typing
from collections.abc import Collection, Generator
from typing import Any, Union

import msgpack

from rollout.protocol.message_base import (
    MAX_HEADER_BYTES,
    MAX_HEADER_CONTAINERS,
    MAX_HEADER_ITEMS,
    MAX_HEADER_MAP_ITEMS,
    MAX_HEADER_STR,
    MAX_ID_LENGTH,
    PROTOCOL_VERSION,
    ClientMessage,
    Message,
    ProtocolError,
)
from rollout.protocol.messages import MESSAGE_TYPES


def encode(message: Message) -> list[bytes]:
    """Turn a message into ZeroMQ frames: the header, then the message's `data_frames` if it has any (a request's
    raw tensor frames are appended by its sender)."""
    header = {"protocol": PROTOCOL_VERSION, "type": message.TYPE}
    # Fields a reply carries already in their plain form (a large one its maker keeps: the weights_spec reply's
    # tensors), set on the message by its maker as {field name: plain value}; they are not converted again.
    given = getattr(message, "plain_fields", None) or {}
    for name in _sent_names(message):
        header[name] = given[name] if name in given else to_plain(getattr(message, name))
    # Raw frames a reply carries after its header (MoE routes, top log-probs: reply_frames.py), set on the message by its maker.
    return [msgpack.packb(header, use_bin_type=True), *getattr(message, "data_frames", ())]


def encode_steps(message: Message) -> Generator[None, None, list[bytes]]:
    """`encode`, in steps: yields after each item of a list of maps (a group result's completions), so that its
    caller can serve others between two; returns the frames, byte for byte those of `encode`. A group result of
    1,024 completions of 2,047 tokens takes about 190 ms to encode: in one call, no other client is served
    meanwhile."""
    packer = msgpack.Packer(use_bin_type=True)
    given = getattr(message, "plain_fields", None) or {}
    names = _sent_names(message)
    parts = [packer.pack_map_header(2 + len(names)), packer.pack("protocol"), packer.pack(PROTOCOL_VERSION)]
    parts += [packer.pack("type"), packer.pack(message.TYPE)]
    for name in names:
        parts.append(packer.pack(name))
        value = given[name] if name in given else getattr(message, name)
        if name in given or not (isinstance(value, list) and value and dataclasses.is_dataclass(value[0])):
            parts.append(packer.pack(value if name in given else to_plain(value)))
            continue
        parts.append(packer.pack_array_header(len(value)))
        for item in value:
            parts.append(packer.pack(to_plain(item)))
            yield
    return [b"".join(parts), *getattr(message, "data_frames", ())]


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
            list is refused before it is built; a map also holds at most MAX_HEADER_MAP_ITEMS entries), and of all
            lists together (checked before their elements).
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
            max_map_len=min(max_items, MAX_HEADER_MAP_ITEMS),
            max_str_len=max_str,
            max_bin_len=max_str,
            max_ext_len=max_str,
        )
    except ValueError as error:
        if "exceeds max_" in str(error):  # msgpack's bound check: the whole header is refused unread
            raise ProtocolError("header", f"a list, map or string is over the limit ({error})") from None
        raise ProtocolError("header", _undecodable(error)) from None
    except Exception as error:  # noqa: BLE001 - any undecodable input is the sender's fault
        raise ProtocolError("header", _undecodable(error)) from None
    if not isinstance(header, dict):
        raise ProtocolError("header", f"expected a map, got {type(header).__name__}")
    try:
        return _checked_message(header, max_items, max_lengths, accept)
    except ProtocolError as error:
        group_id, update_id = header.get("group_id"), header.get("update_id")
        error.group_id = group_id if isinstance(group_id, str) else None
        error.update_id = update_id if isinstance(update_id, str) else None
        error.kind = header["type"] if isinstance(header.get("type"), str) else None
        raise


def _undecodable(error: Exception) -> str:
    """Why msgpack could not decode a header, as a sender can act on it (its own words, cut short)."""
    if isinstance(error, UnicodeDecodeError):
        return "a string is not valid UTF-8"
    if type(error).__name__ == "StackError":  # msgpack's, for nesting past its depth limit
        return "lists and maps nested too deep"
    words = str(error)[:200]
    return f"not a msgpack map of string keys ({type(error).__name__}: {words})"


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
    for name in ("group_id", "update_id") if issubclass(cls, ClientMessage) else ():  # a reply echoes what it got
        value = header.get(name)  # a request's ids must fit the small messages that name them again (cancel, commit)
        if isinstance(value, str) and len(value) > MAX_ID_LENGTH:
            raise ProtocolError(name, f"{len(value)} characters, more than the limit of {MAX_ID_LENGTH}")
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


_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names as its __init__ takes them: positional ones first, keyword-only ones (a base's, such
    as `SampleArrays`) last (`dataclasses.fields` is slow: once per class)."""
    items = dataclasses.fields(cls)
    return tuple(item.name for item in items if not item.kw_only) + tuple(item.name for item in items if item.kw_only)


@functools.cache
def _optional_names(cls: type) -> frozenset[str]:
    """A dataclass's keyword-only fields whose default is None: sent only when set (a decoder fills the default)."""
    return frozenset(item.name for item in dataclasses.fields(cls) if item.kw_only and item.default is None)


def _sent_names(value: Any) -> list[str]:
    """The fields of a dataclass value the codec sends, in order: every one, but unset optional ones."""
    kind, optional = type(value), _optional_names(type(value))
    return [name for name in _field_names(kind) if name not in optional or getattr(value, name) is not None]


def to_plain(value: Any) -> Any:
    """`value` as the codec sends it (msgpack's types): dataclasses as maps, tuples as lists, inside lists and
    dataclasses; a reply's `plain_fields` hold such values (`encode`)."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list and set(map(type, value)) <= _SCALARS:
        return value  # token ids, log-probs: msgpack reads it as it is
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: to_plain(getattr(value, name)) for name in _sent_names(value)}
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
