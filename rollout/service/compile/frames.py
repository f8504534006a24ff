"""Frames between the worker, its compile server and the server's children (server.py): a 4-byte big-endian
length and a JSON object. Small, and free of xgrammar and torch (the worker's side imports it)."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

HEADER = struct.Struct(">I")
READ_BYTES = 1 << 16


def encode(message: dict[str, Any]) -> bytes:
    """One frame: the message's JSON behind its length."""
    body = json.dumps(message).encode()  # (ASCII: a spec's lone surrogate travels escaped)
    return HEADER.pack(len(body)) + body


def decode(buffer: bytearray) -> list[dict[str, Any]]:
    """The complete frames at the start of `buffer`, removed from it (a partial one is left for later)."""
    messages = []
    while len(buffer) >= HEADER.size:
        (length,) = HEADER.unpack_from(buffer)
        if len(buffer) < HEADER.size + length:
            break
        messages.append(json.loads(bytes(buffer[HEADER.size : HEADER.size + length])))
        del buffer[: HEADER.size + length]
    return messages


def read_frame(fd: int, buffer: bytearray) -> dict[str, Any] | None:
    """The next frame from a blocking descriptor (what was read past it stays in `buffer`); None at its end.

    Args:
        fd: the descriptor to read.
        buffer: bytes read from it before and not decoded yet (updated in place).
    """
    while len(buffer) < HEADER.size or len(buffer) < HEADER.size + HEADER.unpack_from(buffer)[0]:
        data = os.read(fd, READ_BYTES)
        if not data:
            return None
        buffer += data
    (length,) = HEADER.unpack_from(buffer)
    message = json.loads(bytes(buffer[HEADER.size : HEADER.size + length]))
    del buffer[: HEADER.size + length]
    return message


def write_frame(fd: int, message: dict[str, Any]) -> None:
    """Write one frame whole to a blocking descriptor."""
    data = memoryview(encode(message))
    while data:
        data = data[os.write(fd, data) :]
