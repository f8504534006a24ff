"""MoE routes on the wire (`SamplingParams.return_routes`): a completion's (or delta's) routes travel as one raw
ZeroMQ frame after the message's header, int16 or, when every expert id fits, uint8, row-major; the header names the
frame and its shape and dtype (`RouteArray`). Never nested lists."""

from __future__ import annotations

from typing import Any

import numpy as np

from rollout.protocol.messages import Delta, GroupResult, RouteArray

ROUTE_DTYPES = {"uint8": np.uint8, "int16": np.int16}


def pack(routes: np.ndarray | None, frames: list[bytes]) -> RouteArray | None:
    """Append `routes` to `frames` (a message's data frames) and return their header entry (None stays None)."""
    if routes is None:
        return None
    narrow = routes.size == 0 or (int(routes.min()) >= 0 and int(routes.max()) < 256)
    dtype = "uint8" if narrow else "int16"
    frames.append(np.ascontiguousarray(routes, dtype=ROUTE_DTYPES[dtype]).tobytes())
    return RouteArray(len(frames) - 1, list(routes.shape), dtype)


def unpack(entry: RouteArray | None, frames: list[Any], field: str) -> np.ndarray | None:
    """The int16 array a header entry names among a message's data frames.

    Raises:
        ValueError: naming `field`: no such frame, an unknown dtype, or a size that is not the shape's.
    """
    if entry is None:
        return None
    if entry.dtype not in ROUTE_DTYPES or not 0 <= entry.frame < len(frames) or len(entry.shape) != 3:
        raise ValueError(f"{field}: frame {entry.frame} of {len(frames)}, dtype {entry.dtype!r}, shape {entry.shape}")
    payload = frames[entry.frame]
    payload = payload.buffer if hasattr(payload, "buffer") else payload
    dtype = np.dtype(ROUTE_DTYPES[entry.dtype])
    if any(size < 0 for size in entry.shape) or len(payload) != int(np.prod(entry.shape)) * dtype.itemsize:
        raise ValueError(f"{field}: {len(payload)} bytes do not hold shape {entry.shape} of {entry.dtype}")
    return np.frombuffer(payload, dtype=dtype).reshape(entry.shape).astype(np.int16)


def unpack_message(message: Any, frames: list[Any]) -> None:
    """Replace the RouteArray entries of a received delta or group_result by their arrays (in place), checked against
    the message: one row per token (per prompt position before the last), one shape of rows, no negative id.

    Raises:
        ValueError: an entry that does not match the frames or the message (named).
    """
    if isinstance(message, GroupResult):
        for index, completion in enumerate(message.completions):
            name = f"completions[{index}]"
            completion.routes = _rows(completion.routes, frames, f"{name}.routes", len(completion.token_ids))
            prompt_rows = len(message.prompt_ids) - 1
            completion.prompt_routes = _rows(completion.prompt_routes, frames, f"{name}.prompt_routes", prompt_rows)
            _same_shape(completion.routes, completion.prompt_routes, name)
    elif isinstance(message, Delta):
        message.routes = _rows(message.routes, frames, "routes", len(message.token_ids))
        message.prompt_routes = _rows(message.prompt_routes, frames, "prompt_routes", None)
        _same_shape(message.routes, message.prompt_routes, "delta")


def _rows(entry: RouteArray | None, frames: list[Any], field: str, rows: int | None) -> np.ndarray | None:
    array = unpack(entry, frames, field)
    if array is None:
        return None
    if rows is not None and len(array) != rows:
        raise ValueError(f"{field}: {len(array)} rows for {rows} tokens")
    if array.size and int(array.min()) < 0:
        raise ValueError(f"{field}: a negative expert id")
    return array


def _same_shape(first: np.ndarray | None, second: np.ndarray | None, field: str) -> None:
    if first is not None and second is not None and len(second) and first.shape[1:] != second.shape[1:]:
        raise ValueError(f"{field}: routes {first.shape[1:]} and prompt_routes {second.shape[1:]} differ")
