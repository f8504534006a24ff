"""Arrays a reply carries in raw ZeroMQ frames after its header, never as nested lists: a completion's (or delta's) MoE
routes (`SamplingParams.return_routes`) and its top log-probs (`top_logprobs`, `prompt_logprobs`). The header names
each frame with its shape and dtype (`FrameArray`); `unpack_message` turns the entries of a received message into
numpy arrays, checked against the message.

- routes: (rows, MoE layers, top_k), uint8 when every expert id fits, else int16; a client gets int16.
- top log-probs: two arrays of one shape (rows, k), the token ids (int32, most likely first) and their log-probs
  (float32); a row whose distribution had fewer than k tokens is padded with id -1 and log-prob NaN.
- prompt log-probs: per prompt position after the first, the prompt token's log-prob (float32) and rank (int32), and
  its top arrays. The samples of a group share their prompt's: a group_result carries them once, in frames every
  completion's entries name (a header list per completion would pass the header's item limits for a large group).

A client's arrays are read-only views of the received frames (routes excepted: int16 copies); `.copy()` one to
write to it. A malformed entry, whatever its numbers, raises `FrameError` naming it, never another exception.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from rollout.protocol.messages import Delta, FrameArray, GroupResult, SampleArrays


class FrameError(ValueError):
    """A reply's frame entry that does not fit its frames or its message; `field` names it (e.g.
    "completions[0].top_token_ids")."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field


FRAME_DTYPES = {"uint8": np.uint8, "int16": np.int16, "int32": np.int32, "float32": np.float32}
ROUTE_DTYPES = ("uint8", "int16")


def pack_array(array: np.ndarray, dtype: str, frames: list[bytes]) -> FrameArray:
    """Append `array` as `dtype` to `frames` (a message's data frames) and return its header entry."""
    frames.append(np.ascontiguousarray(array, dtype=FRAME_DTYPES[dtype]).tobytes())
    return FrameArray(len(frames) - 1, list(array.shape), dtype)


def pack_routes(routes: np.ndarray | None, frames: list[bytes]) -> FrameArray | None:
    """Append `routes` to `frames`, uint8 when every expert id fits, and return their header entry (None stays
    None)."""
    if routes is None:
        return None
    narrow = routes.size == 0 or (int(routes.min()) >= 0 and int(routes.max()) < 256)
    return pack_array(routes, "uint8" if narrow else "int16", frames)


def top_arrays(rows: list[list[tuple[int, float]]]) -> tuple[np.ndarray, np.ndarray] | None:
    """Rows of (token id, log-prob) pairs as (ids int32, log-probs float32), each (rows, k); None when no row has a
    pair (k = 0). One pass over the pairs (on a worker's engine thread, as each sample ends: under 100 ns a pair).

    Args:
        rows: per position, its most likely (token id, log-prob) pairs, most likely first.
    """
    width = max(map(len, rows), default=0)
    if not width:
        return None
    if any(len(row) != width for row in rows):  # a vocabulary smaller than k: every row is, so this is rare
        rows = [list(row) + [(-1, float("nan"))] * (width - len(row)) for row in rows]
    chain = itertools.chain.from_iterable
    flat = np.fromiter(chain(chain(rows)), np.float64, 2 * width * len(rows))  # ids are exact in float64
    pairs = flat.reshape(len(rows), width, 2)
    return pairs[..., 0].astype(np.int32), pairs[..., 1].astype(np.float32)


def pack_top_arrays(
    arrays: tuple[np.ndarray, np.ndarray] | None, frames: list[bytes]
) -> tuple[FrameArray | None, FrameArray | None]:
    """Append `top_arrays`' (ids, log-probs) to `frames` (a message's data frames) and return their header entries
    ((None, None) for None)."""
    if arrays is None:
        return None, None
    return pack_array(arrays[0], "int32", frames), pack_array(arrays[1], "float32", frames)


def pack_top(rows: list[list[tuple[int, float]]], frames: list[bytes]) -> tuple[FrameArray | None, FrameArray | None]:
    """Append rows of (token id, log-prob) pairs as two frames, the ids and the log-probs, and return their header
    entries ((None, None) when no row has a pair: k = 0).

    Args:
        rows: per position, its most likely (token id, log-prob) pairs, most likely first.
        frames: the message's data frames (appended to).
    """
    return pack_top_arrays(top_arrays(rows), frames)


def unpack_array(entry: FrameArray | None, frames: list[Any], field: str, dtypes: tuple[str, ...], ndim: int):
    """The array a header entry names among a message's data frames (None stays None).

    Raises:
        FrameError: naming `field`: no such frame, a dtype not in `dtypes`, a shape of another rank, or a size that
            is not the shape's.
    """
    if entry is None:
        return None
    if entry.dtype not in dtypes or not 0 <= entry.frame < len(frames) or len(entry.shape) != ndim:
        raise FrameError(field, f"frame {entry.frame} of {len(frames)}, dtype {entry.dtype!r}, shape {entry.shape}")
    payload = frames[entry.frame]
    payload = payload.buffer if hasattr(payload, "buffer") else payload
    dtype = np.dtype(FRAME_DTYPES[entry.dtype])
    # math.prod: exact, where numpy's int64 product of a hostile shape wraps around (to 0 for [2**32, 2**32])
    if any(size < 0 for size in entry.shape) or len(payload) != math.prod(entry.shape) * dtype.itemsize:
        raise FrameError(field, f"{len(payload)} bytes do not hold shape {entry.shape} of {entry.dtype}")
    try:
        return np.frombuffer(payload, dtype=dtype).reshape(entry.shape)
    except (ValueError, OverflowError) as error:  # an empty shape numpy cannot make: [0, 2**63]
        raise FrameError(field, f"shape {entry.shape}: {error}") from None


def unpack_message(message: Any, frames: list[Any]) -> None:
    """Replace the `FrameArray` entries of a received delta or group_result by their arrays (in place), checked
    against the message: routes one row per token (per prompt position before the last) of one shape, no negative
    id; top log-probs one row per token (per prompt position after the first), ids and log-probs of one shape.

    Raises:
        FrameError: an entry that does not match the frames or the message (named).
    """
    if isinstance(message, GroupResult):
        prompt_rows = len(message.prompt_ids) - 1
        for index, completion in enumerate(message.completions):
            _unpack_sample(completion, frames, f"completions[{index}].", len(completion.token_ids), prompt_rows)
    elif isinstance(message, Delta):
        _unpack_sample(message, frames, "", len(message.token_ids), None)


def _unpack_sample(sample: SampleArrays, frames: list[Any], prefix: str, rows: int, prompt_rows: int | None):
    """One completion's or delta's arrays (`prompt_rows`: None where the message does not say the prompt's length)."""
    sample.routes = _routes(sample.routes, frames, f"{prefix}routes", rows)
    sample.prompt_routes = _routes(sample.prompt_routes, frames, f"{prefix}prompt_routes", prompt_rows)
    routes, prompt_routes = sample.routes, sample.prompt_routes
    if (
        routes is not None
        and prompt_routes is not None
        and len(prompt_routes)
        and routes.shape[1:] != prompt_routes.shape[1:]
    ):
        raise FrameError(
            f"{prefix}prompt_routes", f"shape {prompt_routes.shape[1:]} differs from routes' {routes.shape[1:]}"
        )
    sample.top_token_ids, sample.top_logprobs = _top(
        sample.top_token_ids, sample.top_logprobs, frames, f"{prefix}top", rows
    )
    _prompt_scores(sample, frames, prefix, prompt_rows)


def _prompt_scores(sample: SampleArrays, frames: list[Any], prefix: str, prompt_rows: int | None) -> None:
    """A sample's prompt log-probs, ranks and top arrays: all or none of the first two, one row per prompt position
    after the first (`prompt_rows` of them, where the message says the prompt's length), ranks of at least 1."""
    logprobs = unpack_array(sample.prompt_logprobs, frames, f"{prefix}prompt_logprobs", ("float32",), 1)
    ranks = unpack_array(sample.prompt_logprob_ranks, frames, f"{prefix}prompt_logprob_ranks", ("int32",), 1)
    if logprobs is None:
        for name in ("prompt_logprob_ranks", "prompt_top_token_ids", "prompt_top_logprobs"):
            if getattr(sample, name) is not None:
                raise FrameError(f"{prefix}{name}", "given without prompt_logprobs")
        return
    rows = len(logprobs) if prompt_rows is None else prompt_rows
    if len(logprobs) != rows:
        raise FrameError(f"{prefix}prompt_logprobs", f"{len(logprobs)} values for {rows} prompt positions")
    if ranks is None or len(ranks) != rows:
        raise FrameError(f"{prefix}prompt_logprob_ranks", f"{'no' if ranks is None else len(ranks)} ranks for {rows}")
    if ranks.size and int(ranks.min()) < 1:
        raise FrameError(f"{prefix}prompt_logprob_ranks", "a rank below 1")
    sample.prompt_logprobs, sample.prompt_logprob_ranks = logprobs, ranks
    sample.prompt_top_token_ids, sample.prompt_top_logprobs = _top(
        sample.prompt_top_token_ids, sample.prompt_top_logprobs, frames, f"{prefix}prompt_top", rows
    )


def _routes(entry: FrameArray | None, frames: list[Any], field: str, rows: int | None) -> np.ndarray | None:
    array = unpack_array(entry, frames, field, ROUTE_DTYPES, 3)
    if array is None:
        return None
    if rows is not None and len(array) != rows:
        raise FrameError(field, f"{len(array)} rows for {rows} tokens")
    if array.size and int(array.min()) < 0:
        raise FrameError(field, "a negative expert id")
    return array.astype(np.int16)


def _top(
    ids_entry: FrameArray | None, logprobs_entry: FrameArray | None, frames: list[Any], field: str, rows: int | None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(token ids, log-probs) of a top log-probs pair of entries: both or neither, one shape, `rows` rows."""
    ids = unpack_array(ids_entry, frames, f"{field}_token_ids", ("int32",), 2)
    logprobs = unpack_array(logprobs_entry, frames, f"{field}_logprobs", ("float32",), 2)
    if ids is None and logprobs is None:
        return None, None
    if ids is None or logprobs is None or ids.shape != logprobs.shape:
        shapes = [None if array is None else list(array.shape) for array in (ids, logprobs)]
        raise FrameError(f"{field}_logprobs", f"shape {shapes[1]} differs from {field}_token_ids' {shapes[0]}")
    if rows is not None and len(ids) != rows:
        raise FrameError(f"{field}_token_ids", f"{len(ids)} rows for {rows} positions")
    if ids.size and int(ids.min()) < -1:
        raise FrameError(f"{field}_token_ids", "a token id below -1")
    return ids, logprobs
