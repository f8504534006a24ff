""" "rollout_invariant" attention: each query's attention computed the same way whatever the padding and the batch.

What makes ordinary attention depend on the layout: the softmax's sums and the weighted sum of values run over the
whole key axis, whose length (and the library's split of it) changes with padding, and left padding moves where a
row's keys start. Here:

- each row's keys are moved to start at its first unmasked key, then cut into blocks of `KEY_BLOCK`, so a key's
  block and its place in it depend on the row alone; padding only adds whole blocks of masked keys at the end;
- queries are cut into tiles of `QUERY_TILE` rows; every score and every block's weighted sum of values is a matmul of
  one fixed shape ((QUERY_TILE, head_dim) x (head_dim, KEY_BLOCK) and (QUERY_TILE, KEY_BLOCK) x (KEY_BLOCK, head_dim));
- the softmax is taken in two passes: the maximum over all keys (exact in any order), then each block's sum of
  exp and weighted values, added block after block in order. A masked key's weight is exactly 0, and a block of
  masked keys adds exactly 0.

Everything runs in fp32 and the output is cast to the query's dtype. Masks come from transformers' `sdpa_mask`
(booleans, never skipped for pure causal), so sliding windows and any mask function transformers builds are honoured.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rollout.invariant.matmul import K_CHUNK, MIN_ROWS
from rollout.invariant.reductions import on_kernel_device

ATTENTION_NAME = "rollout_invariant"
QUERY_TILE = 16  # the Triton kernel's query tile (rows per program)
KEY_BLOCK = 64
EXP_FLOOR = -87.0  # exp(-87) = 1.6e-38, just above fp32's smallest normal number


def allowed_keys(attention_mask: torch.Tensor | None, queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """Which keys each query may see: (batch or 1, 1, queries, keys) booleans (no mask: causal, the queries being
    the last `queries` of the `keys` positions)."""
    if attention_mask is None:
        query_positions = torch.arange(keys - queries, keys, device=device)[:, None]
        return (torch.arange(keys, device=device)[None, :] <= query_positions)[None, None]
    if attention_mask.dtype != torch.bool:
        raise ValueError(
            f"batch-invariant attention takes boolean masks (transformers' sdpa_mask), got {attention_mask.dtype}"
        )
    return attention_mask[:, :1, :, :keys]


def invariant_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The "rollout_invariant" attention function (transformers' AttentionInterface signature).

    Args:
        module: the attention layer (its `training` flag is read for dropout).
        query: (batch, heads, queries, head_dim).
        key, value: (batch, kv_heads, keys, head_dim).
        attention_mask: boolean (batch, 1, queries, keys), True where a key is visible, or None for causal.
        dropout: attention dropout; refused while training (it draws random numbers per layout).
        scaling: the scores' scale (default head_dim ** -0.5).
        softcap: logit soft-capping (Gemma 2), or None.
    Returns:
        (attention output (batch, queries, heads, head_dim), None).
    """
    if dropout and module.training:
        raise ValueError(f"batch-invariant attention cannot apply attention dropout ({dropout}) while training")
    if kwargs.get("s_aux") is not None:
        raise ValueError("batch-invariant attention does not support attention sinks (s_aux)")
    allowed = allowed_keys(attention_mask, query.shape[2], key.shape[2], query.device)
    allowed = allowed.expand(query.shape[0], 1, query.shape[2], key.shape[2])
    # A row's keys start at the first key any of its queries sees: its first unmasked token.
    start = allowed.any(dim=2)[:, 0].long().argmax(dim=-1)  # 0 for a row that sees nothing
    with torch._C.DisableTorchFunction():  # no linear or reduction the invariant mode routes: skip its per-op cost
        out = attend_invariant(query, key, value, allowed, start, scaling, softcap)
    return out.transpose(1, 2).contiguous(), None


def attend_invariant(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    start: torch.Tensor | None,
    scaling: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Batch-invariant attention (module docstring); the engine's paged attention calls it too, with its keys
    gathered from the cache. On a GPU one Triton kernel computes it (`triton_attention.py`; its backward is this
    module's PyTorch arithmetic's), on the CPU PyTorch does.

    Args:
        query: (batch, heads, queries, head_dim).
        key, value: (batch, kv_heads, keys, head_dim).
        allowed: boolean (batch, 1, queries, keys), True where a query sees a key.
        start: (batch,) each row's first key (its first token): key blocks are counted from there; None: 0 for
            every row (the engine's gathered keys).
        scaling: the scores' scale (default head_dim ** -0.5).
        softcap: logit soft-capping, or None.
    Returns:
        (batch, heads, queries, head_dim) in `query`'s dtype.
    """
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    allowed = allowed.expand(query.shape[0], 1, query.shape[2], key.shape[2])  # a batch-1 mask serves every row
    if not on_kernel_device(query):
        return attend_in_torch(query, key, value, allowed, start, scaling, softcap)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return _KernelAttention.apply(query, key, value, allowed, start, scaling, softcap)
    return _attend_in_triton(query, key, value, allowed, start, scaling, softcap)


def _attend_in_triton(query, key, value, allowed, start, scaling, softcap) -> torch.Tensor:  # noqa: ANN001
    from rollout.invariant.triton_attention import attend_invariant_triton  # Triton only where there is a GPU

    return attend_invariant_triton(query, key, value, allowed, start, scaling, softcap, QUERY_TILE, KEY_BLOCK)


class _KernelAttention(torch.autograd.Function):
    """The Triton kernel's forward; the backward of the same arithmetic in PyTorch (recomputed: the gradient need
    not be invariant, as for `invariant_linear`)."""

    @staticmethod
    def forward(ctx: Any, query, key, value, allowed, start, scaling, softcap) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(query, key, value, allowed, start)
        ctx.scaling, ctx.softcap = scaling, softcap
        return _attend_in_triton(query, key, value, allowed, start, scaling, softcap)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, allowed, start = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(needed) for t, needed in zip((query, key, value), ctx.needs_input_grad)]
        with torch.enable_grad():
            out = attend_in_torch(*inputs, allowed, start, ctx.scaling, ctx.softcap)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None, None, None)


def attend_in_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    start: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """`attend_invariant`'s arithmetic in PyTorch (the same arguments; `scaling` given).

    On the CPU an fp32 matmul computes each output element from its row and its column alone, in an order that
    depends on the reduction's length only, whatever the numbers of rows (`MIN_ROWS` or more) and of columns (two or
    more), for reductions of up to `K_CHUNK` (`matmul.py`). So the matmuls put the keys (or head_dim) on the rows and
    the queries of the heads sharing a key head on the columns: the scores are one keys x head_dim by head_dim x
    queries product per key head (a head_dim over `K_CHUNK` in slices added in order), each key block's weighted
    values one head_dim x `KEY_BLOCK` by `KEY_BLOCK` x queries product. Nothing is padded to a tile of queries.
    """
    dtype = query.dtype
    batch, heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    aligned = -(-keys // KEY_BLOCK) * KEY_BLOCK
    blocks = aligned // KEY_BLOCK
    rows = heads // kv_heads * queries  # per key head: its query heads' queries, head after head
    columns = max(rows, 2)  # one column takes a matrix-vector kernel, which sums in another order

    key, value = key.float(), value.float()
    if start is None:  # every row's keys start at 0; only the values' last block is padded (below)
        allowed = torch.nn.functional.pad(allowed, (0, aligned - keys))
        if keys < MIN_ROWS:  # too few rows for the scores' matmul
            key = torch.nn.functional.pad(key, (0, 0, 0, MIN_ROWS - keys))
    else:  # each row's keys from its first one, in whole blocks (the end padded with masked keys)
        index = start[:, None] + torch.arange(aligned, device=query.device)[None, :]
        inside = index < keys
        index = index.clamp(max=keys - 1)
        gather = index[:, None, :, None].expand(batch, kv_heads, aligned, head_dim)
        key, value = key.gather(2, gather), value.gather(2, gather)
        allowed = allowed.gather(3, index[:, None, None, :].expand(batch, 1, queries, aligned))
        allowed = allowed & inside[:, None, None, :]

    # Scores, keys on the rows: (keys, head_dim) x (head_dim, queries) per key head.
    query = query.float().reshape(batch, kv_heads, rows, head_dim)
    if columns > rows:
        query = torch.nn.functional.pad(query, (0, 0, 0, columns - rows))
    query_t = query.transpose(-1, -2)
    scores = torch.matmul(key[..., :K_CHUNK], query_t[..., :K_CHUNK, :])
    for first in range(K_CHUNK, head_dim, K_CHUNK):
        scores = scores + torch.matmul(key[..., first : first + K_CHUNK], query_t[..., first : first + K_CHUNK, :])
    scores = scores[:, :, :aligned, :rows].transpose(-1, -2) * scaling  # (batch, kv_heads, rows, keys)
    if scores.shape[-1] < aligned:
        scores = torch.nn.functional.pad(scores, (0, aligned - scores.shape[-1]))
    scores = scores.reshape(batch, heads, queries, blocks, KEY_BLOCK)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed.view(batch, 1, queries, blocks, KEY_BLOCK), float("-inf"))
    peak = scores.amax(dim=(3, 4), keepdim=True)  # a maximum is exact in any order
    shifted = scores - torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    # Below EXP_FLOOR exp gives denormals, which the CPU computes dozens of times slower: 0 instead (off by < 2e-38,
    # against a row total of at least 1).
    weights = torch.exp(shifted.clamp(min=EXP_FLOOR)).masked_fill(shifted < EXP_FLOOR, 0.0)
    block_totals = weights.sum(dim=-1)  # (batch, heads, queries, blocks)

    # Weighted values, head_dim on the rows: (head_dim, KEY_BLOCK) x (KEY_BLOCK, queries) per block, added in order.
    weights = weights.view(batch, kv_heads, rows, aligned)
    if columns > rows:
        weights = torch.nn.functional.pad(weights, (0, 0, 0, columns - rows))
    out = None
    for block in range(blocks):
        first = block * KEY_BLOCK
        block_value = value[:, :, first : first + KEY_BLOCK]
        if block_value.shape[2] < KEY_BLOCK:  # the last, partial block: zeros after the keys
            block_value = torch.nn.functional.pad(block_value, (0, 0, 0, KEY_BLOCK - block_value.shape[2]))
        part = torch.matmul(block_value.transpose(-1, -2), weights[..., first : first + KEY_BLOCK].transpose(-1, -2))
        out = part if out is None else out + part  # (batch, kv_heads, head_dim, columns)
    total = block_totals[..., 0]
    for block in range(1, blocks):  # in order: the same additions whatever the padding after the row's keys
        total = total + block_totals[..., block]
    out = out[..., :rows].transpose(-1, -2).reshape(batch, heads, queries, head_dim)
    out = torch.where(total[..., None] > 0, out / total[..., None].clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    return out.to(dtype)


def invariant_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' `sdpa_mask`, never skipped for a purely causal batch: the attention always gets booleans."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


@functools.cache
def register_invariant_attention() -> str:
    """Register "rollout_invariant" (its attention and its boolean, never-skipped masks). Idempotent.

    Returns:
        The implementation name to pass to `model.set_attn_implementation`.
    """
    AttentionInterface.register(ATTENTION_NAME, invariant_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, invariant_mask)
    return ATTENTION_NAME
