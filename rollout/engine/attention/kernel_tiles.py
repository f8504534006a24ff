"""The device functions both paged-attention kernels (`triton_kernel.py`) are built from: which query token and head
each row of a program's tile holds, and the online-softmax update of a tile's rows over one run of keys.

A tile's rows hold the `H / Hkv` query heads that share one KV head, so every key and value loaded serves all of
them. Scores and the softmax are fp32; a masked score is selected away, never multiplied (a masked key's slot may
hold a previous owner's NaN, and 0 * NaN is NaN).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_rows(
    tile,
    kv_head,
    tile_seq_ptr,
    tile_start_ptr,
    query_start_ptr,
    HEADS_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """A tile's sequence and its rows: row r holds query token first_query + r // HEADS_PER_KV of that sequence,
    for query head kv_head * HEADS_PER_KV + r % HEADS_PER_KV.

    Args:
        tile, kv_head: the program's tile and KV head.
        tile_seq_ptr, tile_start_ptr, query_start_ptr: the plan's tile -> sequence, tile -> first query token
            within its sequence, and sequence -> first packed query row.
        HEADS_PER_KV, BLOCK_M, BLOCK_Q: query heads per KV head, rows per tile, query tokens per tile.
    Returns:
        (seq, first_query, query_begin, query_len, rows, token, head, row_valid).
    """
    seq = tl.load(tile_seq_ptr + tile)
    first_query = tl.load(tile_start_ptr + tile)  # offset of the tile's first query token within its sequence
    query_begin = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_begin
    rows = tl.arange(0, BLOCK_M)
    token = first_query + rows // HEADS_PER_KV
    head = kv_head * HEADS_PER_KV + rows % HEADS_PER_KV
    row_valid = (rows < BLOCK_Q * HEADS_PER_KV) & (token < query_len)
    return seq, first_query, query_begin, query_len, rows, token, head, row_valid


@triton.jit
def attend_keys(
    q,
    k_rows,
    v_rows,
    key_pos,
    key_valid,
    dims,
    dim_valid,
    query_pos,
    row_valid,
    running_max,
    running_sum,
    acc,
    scale,
    softcap,
    window,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One online-softmax update over a run of keys.

    Args:
        q: the tile's queries (BLOCK_M, BLOCK_D).
        k_rows, v_rows: (keys,) pointers to each key's and value's first element for this KV head.
        key_pos, key_valid: the keys' positions, and which of them exist.
        dims, dim_valid: the head dimension's offsets, and which are within HEAD_DIM.
        query_pos, row_valid: each row's query position, and which rows hold a query.
        running_max, running_sum, acc: the online softmax so far (fp32).
        scale, softcap, window: the softmax scale, the soft-capping value and the sliding window, applied per score
            (`softcap * tanh(s / softcap)` under USE_SOFTCAP; a key visible when q - window < k <= q under
            USE_WINDOW).
        USE_SOFTCAP, USE_WINDOW, DOT_PRECISION, UPCAST: the kernel's constexprs of the same names.
    Returns:
        The new (running_max, running_sum, acc).
    """
    mask = key_valid[:, None] & dim_valid[None, :]
    k = tl.load(k_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale
    if USE_SOFTCAP:
        scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)  # softcap * tanh(scores / softcap)
    allowed = (key_pos[None, :] <= query_pos[:, None]) & row_valid[:, None] & key_valid[None, :]
    if USE_WINDOW:
        allowed = allowed & (key_pos[None, :] > query_pos[:, None] - window)
    scores = tl.where(allowed, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows with nothing visible yet
    probs = tl.exp(scores - safe_max[:, None])
    rescale = tl.exp(running_max - safe_max)
    running_sum = running_sum * rescale + tl.sum(probs, 1)
    v = tl.load(v_rows[:, None] + dims[None, :], mask=mask, other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
    return new_max, running_sum, acc
