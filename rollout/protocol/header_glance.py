"""A glance at a message's header before it is decoded: its type and ids, read from its first few entries.

A worker refuses a trainer-only message from a client without the trainer role, and names the ids of a message cut
for its size, without decoding its header: decoding a legal header of 22 MB (a weights_begin naming 60,000 tensors)
takes 200 to 350 ms of the serving loop, during which no other client is served. The codec writes "protocol" and
"type" first, then each message's fields with its id (group_id or update_id) first, so a glance reads a handful of
small entries and skips nothing large. Whatever is not found there is left to the full decode.
"""

from __future__ import annotations

from typing import Any

import msgpack

# The keys a glance reports (string values only).
GLANCED = ("type", "group_id", "update_id")
GLANCE_ENTRIES = 6  # protocol, type, the id field and a few more: a message written by another encoder may reorder
_GLANCE_LIMIT = 4096  # longest string a glance reads; a longer one, or any list or map, ends the glance


class _Reader:
    """A file-like view of a frame's bytes: msgpack reads only the chunks a glance needs, never the whole frame."""

    def __init__(self, buffer: Any):
        self._view = memoryview(buffer)
        self._offset = 0

    def read(self, size: int) -> bytes:
        chunk = self._view[self._offset : self._offset + size]
        self._offset += len(chunk)
        return bytes(chunk)


def glance(frame: Any, entries: int = GLANCE_ENTRIES) -> dict[str, str]:
    """The string values of "type", "group_id" and "update_id" among a header's first `entries` entries (the first
    of each key). Empty, or partial, for a header that is no msgpack map or holds them later: decode it then.

    Args:
        frame: the header frame (bytes, a buffer, or a zmq.Frame received with copy=False).
        entries: how many of the map's entries to look at.
    """
    found: dict[str, str] = {}
    payload = frame.buffer if hasattr(frame, "buffer") else frame
    # Scalars only: a list or map (nested ones could hold millions of items) or a long string ends the glance, so it
    # reads a few chunks of a header whatever its size.
    limits = {"max_str_len": _GLANCE_LIMIT, "max_bin_len": _GLANCE_LIMIT, "max_ext_len": 0}
    try:
        unpacker = msgpack.Unpacker(
            _Reader(payload), raw=False, read_size=_GLANCE_LIMIT, max_array_len=0, max_map_len=0, **limits
        )
        for _ in range(min(unpacker.read_map_header(), entries)):
            key, value = unpacker.unpack(), unpacker.unpack()
            if key in GLANCED and key not in found and type(value) is str:
                found[key] = value
    except Exception:  # noqa: BLE001 - no map, cut short, a container or a long value: what was found stands
        pass
    return found
