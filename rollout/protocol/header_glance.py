"""A glance at a message's header before it is decoded: its type and ids, read from its first few entries.

A worker refuses a trainer-only message from a client without the trainer role, and names the ids of a message cut
for its size, without decoding its header: decoding a legal header of 22 MB (a weights_begin naming 60,000 tensors)
takes 200 to 350 ms of the serving loop, during which no other client is served. The codec writes "protocol" and
"type" first, then each message's fields with its id (group_id or update_id) first, so a glance reads a handful of
small entries. It reads at most the header's first GLANCE_BYTES, whatever the header holds; what it cannot find
there (an id longer than that, a header from an encoder that orders its keys otherwise) is left to the full decode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from rollout.protocol.messages import MESSAGE_TYPES

# The keys a glance reports (string values only).
GLANCED = ("type", "group_id", "update_id")
IDS = ("group_id", "update_id")
GLANCE_ENTRIES = 6  # protocol, type, the id field and a few more: a message written by another encoder may reorder
GLANCE_BYTES = 16 << 10  # the most of a header a glance reads (msgpack takes in a whole value before its checks)


def glance(frame: Any, entries: int = GLANCE_ENTRIES) -> dict[str, str]:
    """The string values of "type", "group_id" and "update_id" among a header's first `entries` entries (the first
    of each key), read from its first GLANCE_BYTES. Empty, or partial, for a header that is no msgpack map or holds
    them later or longer.

    Args:
        frame: the header frame (bytes, a buffer, or a zmq.Frame received with copy=False).
        entries: how many of the map's entries to look at.
    """
    found: dict[str, str] = {}
    payload = frame.buffer if hasattr(frame, "buffer") else frame
    # Scalars only: a list or map (nested ones could hold millions of items) ends the glance.
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=GLANCE_BYTES, max_array_len=0, max_map_len=0, max_ext_len=0)
    try:
        unpacker.feed(memoryview(payload)[:GLANCE_BYTES])
        for _ in range(min(unpacker.read_map_header(), entries)):
            key, value = unpacker.unpack(), unpacker.unpack()
            if key in GLANCED and key not in found and type(value) is str:
                found[key] = value
    except Exception:  # noqa: BLE001 - no map, cut short, a container or a long value: what was found stands
        pass
    return found


def glance_ids(frame: Any) -> dict[str, str] | None:
    """The header's type and every id its message type carries, when a glance finds them all; None: decode it.

    Args:
        frame: the header frame.
    """
    seen = glance(frame)
    kind = MESSAGE_TYPES.get(seen.get("type", ""))
    if kind is None:
        return None
    carried = [item.name for item in dataclasses.fields(kind) if item.name in IDS]
    return seen if all(name in seen for name in carried) else None


# Message types whose every legal header is small (ids, a nonce): one far larger carries junk, refused unread.
SMALL_TYPES = frozenset(
    {"ping", "stats", "hello", "cancel", "weights_spec", "weights_commit", "weights_abort", "adapter_unload"}
)
SMALL_HEADER_BYTES = 64 << 10


def oversized(frame: Any) -> str | None:
    """Why a header is refused before it is decoded (None: decode it): a type in `SMALL_TYPES` with a header over
    `SMALL_HEADER_BYTES` (a ping holding a list of a million items would otherwise be decoded whole, on the serving
    loop, before its unknown field is refused).

    Args:
        frame: the header frame.
    """
    payload = frame.buffer if hasattr(frame, "buffer") else frame
    size = memoryview(payload).nbytes
    if size <= SMALL_HEADER_BYTES:
        return None
    kind = glance(frame).get("type")
    if kind not in SMALL_TYPES:
        return None
    return f"a {kind} header of {size} bytes, more than any {kind} needs ({SMALL_HEADER_BYTES})"
