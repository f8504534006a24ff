"""`attend_invariant` on a GPU: one Triton kernel computing attention.py's arithmetic with fixed tiles.

Each program takes one tile of `QUERY_TILE` queries of one head of one row and walks that row's keys in blocks of
`KEY_BLOCK` counted from the row's first key, in order, twice: first for the scores' maximum (exact in any order),
then for each block's sum of exp and its weighted values ((QUERY_TILE, head_dim) x (head_dim, KEY_BLOCK) and
(QUERY_TILE, KEY_BLOCK) x (KEY_BLOCK, head_dim) products in fp32), added block after block. A query's result depends
on its own row's keys only: not on the batch, the padding, the other queries of its tile or the GPU's occupancy
(cuBLAS's batched matmuls, which the PyTorch version of the same arithmetic uses, pick kernels by the batch's shape).
A row's keys are read through a table of storage blocks: the engine's paged cache in place
(`attend_invariant_paged_triton`), or a dense batch whose rows are one block each (`attend_invariant_triton`, the
trainer's), so both run the very same kernel.

Every call runs one compiled kernel (per dtype, head_dim and softcap). Triton compiles a kernel per specialization of
its arguments (an integer equal to 1 becomes a constant, integers divisible by 16 and 16-byte-aligned pointers are
assumed so), and the compiler lays the block's exp weights out over the threads by what it may assume: a decode's
single query, or keys counted from a known 0, gave the sum of a block's weights another tree of additions than a
trainer's padded batch (compiled for sm_90: the engine's and the trainer's forwards then differed in bf16 on an
H200). So no argument is specialized: integers are 64-bit and never constants, pointers are not assumed aligned, and
every call passes each row's first key (zeros for the engine's gathered keys). Runs in Triton's interpreter on CPU
tensors for the tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rollout.invariant.triton_matmul import _INTERPRETED

NUM_WARPS = 4


@triton.jit
def _block_scores(
    q,
    k_head,
    table_row,
    allowed_row,
    end,
    block_size,
    first,
    block,
    query,
    dims,
    head_dim,
    scaling,
    softcap,
    stride_kb,
    stride_kn,
    stride_kd,
    stride_tn,
    stride_am,
    stride_an,
    queries,
    KEY_BLOCK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    IN_ORDER: tl.constexpr,
):
    """One key block's scores for the query tile (masked keys at -inf), and where its keys are: (scores, each key's
    storage block, its slot in that block, whether it is inside the row, whether a query of the tile sees it)."""
    key = first + block * KEY_BLOCK + tl.arange(0, KEY_BLOCK)
    inside = key < end
    stored = tl.load(table_row + (key // block_size) * stride_tn, mask=inside, other=0)
    slot = key % block_size
    k = tl.load(
        k_head + stored[None, :] * stride_kb + slot[None, :] * stride_kn + dims[:, None] * stride_kd,
        mask=inside[None, :] & (dims[:, None] < head_dim),
        other=0.0,
    ).to(tl.float32)
    if IN_ORDER:  # Triton's interpreter: products summed in order (triton_matmul's _INTERPRETED)
        scores = tl.sum(q[:, :, None] * k[None, :, :], axis=1) * scaling
    else:
        scores = tl.dot(q, k, input_precision="ieee") * scaling
    if HAS_SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1)
        scores = (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0)) * softcap
    seen = tl.load(
        allowed_row + query[:, None] * stride_am + key[None, :] * stride_an,
        mask=(query[:, None] < queries) & inside[None, :],
        other=0,
    )
    return tl.where(seen != 0, scores, float("-inf")), stored, slot, inside, tl.max(seen, axis=0) != 0


# Never specialized (module docstring): every call compiles to one kernel.
POINTERS = ("q_ptr", "k_ptr", "v_ptr", "table_ptr", "allowed_ptr", "start_ptr", "end_ptr", "out_ptr")
INTEGERS = (
    "queries", "block_size", "heads_per_kv", "head_dim",
    "stride_qb", "stride_qh", "stride_qm", "stride_qd", "stride_kb", "stride_kh", "stride_kn", "stride_kd",
    "stride_vb", "stride_vh", "stride_vn", "stride_vd", "stride_tb", "stride_tn", "stride_ab", "stride_am",
    "stride_an", "stride_ob", "stride_oh", "stride_om", "stride_od",
)  # fmt: skip


@triton.jit(do_not_specialize=INTEGERS, do_not_specialize_on_alignment=POINTERS)
def invariant_attention_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, allowed_ptr, start_ptr, end_ptr, out_ptr,
    queries: tl.int64, block_size: tl.int64, heads_per_kv: tl.int64, head_dim: tl.int64,
    scaling, softcap,
    stride_qb: tl.int64, stride_qh: tl.int64, stride_qm: tl.int64, stride_qd: tl.int64,
    stride_kb: tl.int64, stride_kh: tl.int64, stride_kn: tl.int64, stride_kd: tl.int64,
    stride_vb: tl.int64, stride_vh: tl.int64, stride_vn: tl.int64, stride_vd: tl.int64,
    stride_tb: tl.int64, stride_tn: tl.int64,
    stride_ab: tl.int64, stride_am: tl.int64, stride_an: tl.int64,
    stride_ob: tl.int64, stride_oh: tl.int64, stride_om: tl.int64, stride_od: tl.int64,
    QUERY_TILE: tl.constexpr, KEY_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IN_ORDER: tl.constexpr,
):  # fmt: skip
    """out[row, head, tile's queries] = softmax(q k^T * scaling) v over the row's keys, fp32 throughout. A row's key
    `i` is slot `i % block_size` of storage block `table[row, i // block_size]` (k and v: (blocks, kv_heads, slots,
    head_dim) by their strides): a paged cache's blocks, or a dense batch whose rows are one block each."""
    tile, head, row = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    kv_head = head // heads_per_kv
    query = tile.to(tl.int64) * QUERY_TILE + tl.arange(0, QUERY_TILE)  # int64: queries x keys may pass 2**31
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + row * stride_qb + head * stride_qh + query[:, None] * stride_qm + dims[None, :] * stride_qd,
        mask=(query[:, None] < queries) & (dims[None, :] < head_dim),
        other=0.0,
    ).to(tl.float32)
    first, end = tl.load(start_ptr + row), tl.load(end_ptr + row)  # the row's keys: [first, end)
    blocks = tl.cdiv(end - first, KEY_BLOCK)  # the blocks past `end` would add exactly 0: not walked
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    table_row = table_ptr + row * stride_tb
    allowed_row = allowed_ptr + row * stride_ab
    peak = tl.full((QUERY_TILE,), float("-inf"), dtype=tl.float32)
    for block in range(0, blocks):
        scores, _, _, _, _ = _block_scores(q, k_head, table_row, allowed_row, end, block_size, first, block, query,
                                        dims, head_dim, scaling, softcap, stride_kb, stride_kn, stride_kd,
                                        stride_tn, stride_am, stride_an, queries, KEY_BLOCK, HAS_SOFTCAP,
                                        IN_ORDER)  # fmt: skip
        peak = tl.maximum(peak, tl.max(scores, axis=1))
    shift = tl.where(peak > float("-inf"), peak, 0.0)
    total = tl.zeros((QUERY_TILE,), dtype=tl.float32)
    out = tl.zeros((QUERY_TILE, HEAD_DIM), dtype=tl.float32)
    for block in range(0, blocks):  # in order: the same additions whatever comes after the row's keys
        scores, stored, slot, inside, seen = _block_scores(q, k_head, table_row, allowed_row, end, block_size,
                                                           first, block, query, dims, head_dim, scaling, softcap,
                                                           stride_kb, stride_kn, stride_kd, stride_tn, stride_am,
                                                           stride_an, queries, KEY_BLOCK, HAS_SOFTCAP,
                                                           IN_ORDER)  # fmt: skip
        weights = tl.exp(scores - shift[:, None])  # a masked key's weight is exactly 0
        v = tl.load(
            v_head + stored[:, None] * stride_vb + slot[:, None] * stride_vn + dims[None, :] * stride_vd,
            mask=inside[:, None] & (dims[None, :] < head_dim),
            other=0.0,
        ).to(tl.float32)
        # A key no query sees weighs exactly 0, but 0 x NaN is NaN: a paged cache's slots past a sequence's end may
        # hold a previous owner's values, NaN included. They count as 0 (0 x a finite value adds 0 all the same).
        v = tl.where(seen[:, None], v, 0.0)
        total += tl.sum(weights, axis=1)
        if IN_ORDER:
            out += tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        else:
            out += tl.dot(weights, v, input_precision="ieee")
    safe = tl.where(total > 0, total, 1.0)
    out = tl.where(total[:, None] > 0, out / safe[:, None], 0.0)
    tl.store(
        out_ptr + row * stride_ob + head * stride_oh + query[:, None] * stride_om + dims[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=(query[:, None] < queries) & (dims[None, :] < head_dim),
    )


def attend_invariant_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    start: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    query_tile: int,
    key_block: int,
) -> torch.Tensor:
    """attention.py's `attend_invariant` arithmetic in one kernel (module docstring); the same arguments.

    Args:
        query: (batch, heads, queries, head_dim).
        key, value: (batch, kv_heads, keys, head_dim).
        allowed: boolean (batch, 1, queries, keys) (broadcast over a size-1 batch).
        start: (batch,) each row's first key, or None (0 for every row).
        scaling: the scores' scale.
        softcap: logit soft-capping, or None.
        query_tile, key_block: the tile sizes (attention.py's QUERY_TILE and KEY_BLOCK).
    Returns:
        (batch, heads, queries, head_dim) in `query`'s dtype.
    """
    rows = torch.arange(query.shape[0], device=query.device).unsqueeze(1)  # each row one block of all its keys
    layout = _Storage(key, value, key.stride(), value.stride(), key.shape[1], rows, key.shape[2])
    return _launch(query, layout, allowed, start, None, scaling, softcap, query_tile, key_block)


def attend_invariant_paged_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    allowed: torch.Tensor,
    ends: torch.Tensor,
    scaling: float,
    softcap: float | None,
    query_tile: int,
    key_block: int,
) -> torch.Tensor:
    """The same kernel reading a paged cache's blocks where they are (the engine's attention): the same bits as
    `attend_invariant_triton` over those keys gathered, as it is the same compiled kernel. Each row walks its keys
    up to `ends` only: the key blocks after it hold no key the row's queries see, and would add exactly 0.

    Args:
        query: (batch, heads, queries, head_dim).
        key_cache, value_cache: (num_blocks, block_size, kv_heads, head_dim).
        block_table: (batch, blocks) each row's blocks, in order, from its first token.
        allowed: boolean (batch, 1, queries, blocks * block_size) (broadcast over a size-1 batch).
        ends: (batch,) int64, each row's keys seen by its queries: its last query's position + 1.
        scaling, softcap, query_tile, key_block: as `attend_invariant_triton`'s.
    Returns:
        (batch, heads, queries, head_dim) in `query`'s dtype.
    """
    # The cache's strides in the kernel's (blocks, kv_heads, slots, head_dim) order.
    key_strides, value_strides = (tuple(c.stride(i) for i in (0, 2, 1, 3)) for c in (key_cache, value_cache))
    layout = _Storage(
        key_cache, value_cache, key_strides, value_strides, key_cache.shape[2], block_table.long(), key_cache.shape[1]
    )
    return _launch(query, layout, allowed, None, ends, scaling, softcap, query_tile, key_block)


class _Storage(NamedTuple):
    """Where the kernel reads keys and values: (blocks, kv_heads, slots, head_dim) strides, and each row's blocks."""

    key: torch.Tensor
    value: torch.Tensor
    key_strides: tuple[int, ...]
    value_strides: tuple[int, ...]
    kv_heads: int
    table: torch.Tensor  # (batch, blocks) int64
    block_size: int


def _launch(
    query: torch.Tensor,
    storage: _Storage,
    allowed: torch.Tensor,
    start: torch.Tensor | None,
    ends: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    query_tile: int,
    key_block: int,
) -> torch.Tensor:
    """Launch the kernel over `storage`: each row's keys `table.shape[1] * block_size` long, walked from `start`
    (None: 0) to `ends` (None: that length)."""
    batch, heads, queries, head_dim = query.shape
    keys = storage.table.shape[1] * storage.block_size
    out = torch.empty_like(query)
    if out.numel() == 0 or keys == 0:
        return out.zero_()
    allowed = allowed.expand(batch, 1, queries, keys).view(torch.uint8)
    # Always each row's first key: a constant 0 would compile another kernel (module docstring).
    starts = start.long() if start is not None else torch.zeros(batch, dtype=torch.long, device=query.device)
    ends = ends.long() if ends is not None else torch.full((batch,), keys, dtype=torch.long, device=query.device)
    grid = (triton.cdiv(queries, query_tile), heads, batch)
    head_tile = max(16, triton.next_power_of_2(head_dim))
    # fp32 tiles 256 wide (Gemma 2's head dim): the key loop software-pipelined holds 218 KB of shared memory, over an
    # A100's 163 KB (its launch fails); one stage holds 86 KB on every target. Every such call takes the same kernel.
    stages = {"num_stages": 1} if query.dtype == torch.float32 and head_tile >= 256 else {}
    invariant_attention_kernel[grid](
        query, storage.key, storage.value, storage.table, allowed, starts, ends, out,
        queries, storage.block_size, heads // storage.kv_heads, head_dim, float(scaling), float(softcap or 1.0),
        *query.stride(), *storage.key_strides, *storage.value_strides, *storage.table.stride(),
        allowed.stride(0), allowed.stride(2), allowed.stride(3),
        *out.stride(),
        QUERY_TILE=query_tile, KEY_BLOCK=key_block, HEAD_DIM=head_tile,
        HAS_SOFTCAP=softcap is not None,
        IN_ORDER=_INTERPRETED,
        num_warps=NUM_WARPS, enable_fp_fusion=False, **stages,
    )  # fmt: skip
    return out
