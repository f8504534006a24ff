"""What every wire message shares: the protocol version, the limits a decoded header must respect, `ProtocolError`,
and the base classes the message dataclasses derive from (`messages.py`, `weight_messages.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# 2: torch.distributed buckets travel as one broadcast each (1: one per piece); 3: generate carries `session`
PROTOCOL_VERSION = 3
# The nonce of the unsolicited pong a worker may send to check that a client's connection is still up.
PROBE_NONCE = -1
# Largest frame a worker accepts (a weight bucket's pieces are split below it); larger ones drop the connection.
MAX_FRAME_BYTES = 256 << 20
# Most items of any list or map in a header, and the longest string or bytes value in one (tensor bytes travel in
# frames of their own): checked while msgpack decodes, so an oversized list is refused before it is built.
MAX_HEADER_ITEMS = 1 << 20
MAX_HEADER_STR = 1 << 20
# The longest group_id or update_id, in characters (a uuid is 36): a cancel or a weights_commit naming one stays a
# small header (`header_glance.SMALL_HEADER_BYTES`).
MAX_ID_LENGTH = 1024
# Most maps and lists in a header together (each costs an object to build: a header of a million tiny maps took a
# second to decode); a weight update's pieces and tensors are bounded below it.
MAX_HEADER_CONTAINERS = 1 << 17
# Most entries of one map in a header (a message's maps are small: sampling fields, logit_bias, a schema's objects, a
# tensor's spec): a map of a million keys fits the header's bytes, and took over half a second to decode.
MAX_HEADER_MAP_ITEMS = 1 << 16
# Largest header frame (a prompt of a million tokens is ~5 MB, an update announcing 65,536 tensors ~15 MB).
MAX_HEADER_BYTES = 32 << 20


class ProtocolError(ValueError):
    """A message that cannot be decoded or has a wrong field.

    Attributes:
        field: the offending field ("header" when the bytes are not a message at all, "type" for unknown types).
        reason: what is wrong with it.
        group_id, update_id: the message's ids when its header still had string ones (so the answer can be routed
            to the waiting call), else None.
        kind: the header's "type" when it was a string, else None (a malformed weight message drops its update; a
            malformed message of another type naming the update does not).
    """

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
        self.group_id: str | None = None
        self.update_id: str | None = None
        self.kind: str | None = None


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
