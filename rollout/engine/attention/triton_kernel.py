"""Paged attention in Triton: one kernel for decode, prefill and mixed batches (varlen queries over the paged KV
cache), with split-K over the block table for long decodes. Selected automatically on CUDA; tested against a plain
PyTorch reference on GPU and, with `TRITON_INTERPRET=1`, on CPU.

Layout: queries packed as (T, H, D); the cache layer as (num_blocks, block_size, Hkv, D). A program takes one KV
head and a tile of query tokens of one sequence, and holds the `H / Hkv` query heads that share that KV head in the
rows of its tile, so every key and value block is loaded once per KV head (decode: one token x the group's heads).
Keys past a tile's last query (slots of its last block that the sequence has not written, which may hold a previous
owner's NaN) are never loaded: a masked score is selected away, but 0 * NaN in the value product would not be.
Scores and the softmax are fp32 (online softmax); sliding windows (a key is visible when q - window < k <= q) and
logit soft-capping (`softcap * tanh(s / softcap)`, Gemma 2) are applied per score. A tile's rows and the softmax
update over a run of keys are device functions both kernels share (`kernel_tiles.py`); the kernels stay here, where
`paged_attention` looks them up at each launch (`rollout.benchmarks.kernels` swaps them for recorders).

With split-K, each program covers a slice of the key blocks and writes its partial (max, sum, accumulator); a second
kernel merges the slices. `plan_splits` chooses the number of slices from the batch shape.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from rollout.engine.attention.kernel_plan import MAX_KEY_CHUNK, TritonAttentionPlan
from rollout.engine.attention.kernel_tiles import attend_keys, tile_rows

# Triton's CPU interpreter computes tl.dot wrongly on bf16/fp16 operands: there, products are taken in fp32.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    block_table_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    query_start_ptr,
    context_ptr,
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    HEADS_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCKS_PER_ITER: tl.constexpr,
    KEY_CHUNK: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    seq, first_query, query_begin, query_len, rows, token, head, row_valid = tile_rows(
        tile, kv_head, tile_seq_ptr, tile_start_ptr, query_start_ptr, HEADS_PER_KV, BLOCK_M, BLOCK_Q
    )
    context = tl.load(context_ptr + seq)  # tokens cached before this step
    query_pos = context + token
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (query_begin + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Keys [lo, hi): up to the tile's last query, from the first one's window start.
    last_token = tl.minimum(first_query + BLOCK_Q, query_len) - 1
    hi = context + last_token + 1
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context + first_query - window + 1, 0)
    first_block = lo // BLOCK_N
    num_blocks = (hi + BLOCK_N - 1) // BLOCK_N - first_block
    per_split = (num_blocks + NUM_SPLITS - 1) // NUM_SPLITS
    block_lo = first_block + split * per_split
    block_hi = tl.minimum(block_lo + per_split, first_block + num_blocks)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if BLOCKS_PER_ITER == 1:  # one block per iteration (blocks of 64 tokens or more), KEY_CHUNK keys per product
        chunks = BLOCK_N // KEY_CHUNK  # wider blocks: one loop over (block, chunk) pairs, pipelined as one block's
        for step in range(block_lo * chunks, block_hi * chunks):
            block = step // chunks
            slots = (step % chunks) * KEY_CHUNK + tl.arange(0, KEY_CHUNK)
            physical = tl.load(block_table_ptr + seq * stride_bt + block).to(tl.int64)
            running_max, running_sum, acc = attend_keys(
                q, k_cache_ptr + physical * stride_kb + slots * stride_ks + kv_head * stride_kh,
                v_cache_ptr + physical * stride_vb + slots * stride_vs + kv_head * stride_vh,
                block * BLOCK_N + slots, block * BLOCK_N + slots < hi, dims, dim_valid, query_pos, row_valid,
                running_max, running_sum, acc, scale, softcap, window, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION, UPCAST,
            )  # fmt: skip
    else:  # several blocks per iteration: their table entries load together and each product covers more keys
        keys = tl.arange(0, BLOCK_N * BLOCKS_PER_ITER)
        slot = keys % BLOCK_N
        for first in range(block_lo, block_hi, BLOCKS_PER_ITER):
            block = first + keys // BLOCK_N
            valid = (block < block_hi) & (block * BLOCK_N + slot < hi)  # no slot past the tile's last query
            physical = tl.load(block_table_ptr + seq * stride_bt + block, mask=valid, other=0).to(tl.int64)
            running_max, running_sum, acc = attend_keys(
                q, k_cache_ptr + physical * stride_kb + slot * stride_ks + kv_head * stride_kh,
                v_cache_ptr + physical * stride_vb + slot * stride_vs + kv_head * stride_vh,
                block * BLOCK_N + slot, valid, dims, dim_valid, query_pos, row_valid,
                running_max, running_sum, acc, scale, softcap, window, USE_SOFTCAP, USE_WINDOW, DOT_PRECISION, UPCAST,
            )  # fmt: skip

    if NUM_SPLITS == 1:
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(
            out_ptr
            + (query_begin + token).to(tl.int64)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        part = (tile * num_kv_heads + kv_head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part * BLOCK_M + rows, running_max)
        tl.store(part_sum_ptr + part * BLOCK_M + rows, running_sum)
        tl.store(part_acc_ptr + (part * BLOCK_M + rows)[:, None] * BLOCK_D + dims[None, :], acc)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    query_start_ptr,
    stride_ot,
    stride_oh,
    HEADS_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    _, _, query_begin, _, rows, token, head, row_valid = tile_rows(
        tile, kv_head, tile_seq_ptr, tile_start_ptr, query_start_ptr, HEADS_PER_KV, BLOCK_M, BLOCK_Q
    )
    dims = tl.arange(0, BLOCK_D)
    base = (tile * num_kv_heads + kv_head) * NUM_SPLITS

    overall_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for split in range(NUM_SPLITS):
        overall_max = tl.maximum(overall_max, tl.load(part_max_ptr + (base + split) * BLOCK_M + rows))
    safe_max = tl.where(overall_max == float("-inf"), 0.0, overall_max)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(NUM_SPLITS):
        part = base + split
        weight = tl.exp(tl.load(part_max_ptr + part * BLOCK_M + rows) - safe_max)
        total += tl.load(part_sum_ptr + part * BLOCK_M + rows) * weight
        acc += tl.load(part_acc_ptr + (part * BLOCK_M + rows)[:, None] * BLOCK_D + dims[None, :]) * weight[:, None]
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(
        out_ptr + (query_begin + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :],
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attention_plan: TritonAttentionPlan,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of packed queries over the paged cache (the new tokens' keys/values already written).

    Args:
        query: (T, H, D) queries, sequences packed in `attention_plan.query_start` order.
        key_cache, value_cache: (num_blocks, block_size, Hkv, D) one layer of the cache.
        attention_plan: from `plan`.
        scale: softmax scale.
        sliding_window: the layer's window, or None.
        softcap: logit soft-capping, or None.
    Returns:
        (T, H, D) attention output, in the query's dtype.
    """
    tokens, heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    heads_per_kv = heads // num_kv_heads
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two block_size >= 16, got {block_size}")
    query = query.contiguous()
    output = torch.empty_like(query)
    p = attention_plan
    num_tiles = p.tile_seq.numel()
    if num_tiles == 0:
        return output
    block_d = max(16, triton.next_power_of_2(head_dim))
    splits = p.num_splits
    if splits > 1:
        shape = (num_tiles * num_kv_heads * splits, p.block_m)
        part_max = torch.empty(shape, dtype=torch.float32, device=query.device)
        part_sum = torch.empty(shape, dtype=torch.float32, device=query.device)
        part_acc = torch.empty((*shape, block_d), dtype=torch.float32, device=query.device)
    else:
        part_max = part_sum = part_acc = output  # unused
    # fp32 tiles 256 wide (Gemma 2's head dim) with 32+ query rows and 64-token blocks overflow an A100's shared
    # memory when the key loop is software-pipelined (213 KB > 163 KB); one stage fits (148 KB) on every target.
    # Their fp32 products are FMAs, not tensor-core MMAs: over 4 warps each thread holds 128 accumulator registers
    # and spills, and ptxas takes about a minute per variant; 8 warps halve both (18 s instead of 66 s for sm_90).
    options = {"num_stages": 1, "num_warps": 8} if query.dtype == torch.float32 and block_d >= 256 else {}
    _paged_attention_kernel[(num_tiles, num_kv_heads, splits)](
        query,
        key_cache,
        value_cache,
        output,
        part_acc,
        part_max,
        part_sum,
        p.block_table,
        p.tile_seq,
        p.tile_start,
        p.query_start,
        p.context,
        scale,
        softcap or 1.0,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        output.stride(0),
        output.stride(1),
        p.block_table.stride(0),
        HEADS_PER_KV=heads_per_kv,
        HEAD_DIM=head_dim,
        BLOCK_M=p.block_m,
        BLOCK_Q=p.block_q,
        BLOCK_N=block_size,
        BLOCK_D=block_d,
        USE_SOFTCAP=softcap is not None,
        USE_WINDOW=sliding_window is not None,
        NUM_SPLITS=splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # fp32 models keep fp32 products
        UPCAST=_INTERPRETED and query.dtype != torch.float32,
        BLOCKS_PER_ITER=p.blocks_per_iter,
        KEY_CHUNK=min(block_size, MAX_KEY_CHUNK),
        **options,
    )
    if splits > 1:
        _merge_splits_kernel[(num_tiles, num_kv_heads)](
            output,
            part_acc,
            part_max,
            part_sum,
            p.tile_seq,
            p.tile_start,
            p.query_start,
            output.stride(0),
            output.stride(1),
            HEADS_PER_KV=heads_per_kv,
            HEAD_DIM=head_dim,
            BLOCK_M=p.block_m,
            BLOCK_Q=p.block_q,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
        )
    return output
