""" "rollout_invariant" attention: each query's attention computed the same way whatever the padding and the batch.

What makes ordinary attention depend on the layout: the softmax's sums and the weighted sum of values run over the
whole key axis, whose length (and the library's split of it) changes with padding, and left padding moves where a
row's keys start. Here:

- each row's keys are moved to start at its first unmasked key, then cut into blocks of `KEY_BLOCK`, so a key's
  block and its place in it depend on the row alone; padding only adds whole blocks of masked keys at the end;
- every score and every block's weighted sum of values is computed the same way whatever the number of queries and
  keys: on a GPU as matmuls of one fixed shape in a Triton kernel (tiles of `QUERY_TILE` queries); on the CPU as
  matmuls whose element arithmetic does not depend on their shape (`attend_in_torch`);
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

from rollout.invariant.matmul import K_CHUNK
from rollout.invariant.reductions import on_kernel_device

ATTENTION_NAME = "rollout_invariant"
QUERY_TILE = 16  # the Triton kernel's query tile (rows per program)
KEY_BLOCK = 64
EXP_FLOOR = -87.0  # exp(-87) = 1.6e-38, just above fp32's smallest normal number
HIDDEN_SCORE = 3e38  # subtracted from a hidden key's score (finite: a row that sees nothing gets weights 0 x finite)


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
    depends on the reduction's length only, whatever the numbers of rows (`matmul.MIN_ROWS` or more: here whole
    blocks of keys) and of columns (two or more), for reductions of up to `K_CHUNK` (`matmul.py`). So everything is laid out keys by queries, the queries
    of the heads sharing a key head side by side as the columns: the scores are one (keys, head_dim) x (head_dim,
    queries) product per key head (a head_dim over `K_CHUNK` in slices added in order), and each key block's
    weighted values one (head_dim, `KEY_BLOCK`) x (`KEY_BLOCK`, queries) product. Nothing is padded to a tile of
    queries, and no key is copied per head. The softmax runs queries by keys, each block's sum over its contiguous
    `KEY_BLOCK` weights.
    """
    dtype = query.dtype
    batch, heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    aligned = -(-keys // KEY_BLOCK) * KEY_BLOCK
    blocks = aligned // KEY_BLOCK

    if start is None:  # every row's keys start at 0: copied once, in fp32, whole blocks (zeros after the keys)
        allowed = torch.nn.functional.pad(allowed, (0, aligned - keys))
        key, value = _in_blocks(key, aligned), _in_blocks(value, aligned)
    else:  # each row's keys from its first one, in whole blocks (the end masked)
        index = start[:, None] + torch.arange(aligned, device=query.device)[None, :]
        inside = index < keys
        index = index.clamp(max=keys - 1)
        gather = index[:, None, :, None].expand(batch, kv_heads, aligned, head_dim)
        key, value = key.float().gather(2, gather), value.float().gather(2, gather)
        allowed = allowed.gather(3, index[:, None, None, :].expand(batch, 1, queries, aligned))
        allowed = allowed & inside[:, None, None, :]

    # Scores, keys by queries: (keys, head_dim) x (head_dim, group * queries) per key head.
    query = query.float().reshape(batch, kv_heads, group * queries, head_dim)
    if group * queries == 1:  # one column takes a matrix-vector kernel: the query twice, as two heads
        query, group = query.expand(batch, kv_heads, 2, head_dim), 2
    columns = group * queries
    query_t = query.transpose(-1, -2)
    scores = torch.matmul(key[..., :K_CHUNK], query_t[..., :K_CHUNK, :])
    for first in range(K_CHUNK, head_dim, K_CHUNK):
        scores = scores + torch.matmul(key[..., first : first + K_CHUNK], query_t[..., first : first + K_CHUNK, :])
    # The softmax runs queries by keys, in memory too: an elementwise result keeps its input's layout, and a sum
    # over a strided last axis adds in an order that depends on the other axes' sizes.
    scores = (
        scores.transpose(-1, -2).contiguous().view(batch, kv_heads, group, queries, blocks, KEY_BLOCK)
    )  # a new tensor
    # Masks as float arithmetic (boolean masked_fill / where run 20-30x slower than an add on the CPU): a hidden
    # key's score sinks below every seen one (x + 0 is x exactly), and its weight is multiplied by exactly 0.
    seen = allowed.to(torch.float32).view(batch, 1, 1, queries, blocks, KEY_BLOCK)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        scores = scores * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores + (seen - 1.0) * HIDDEN_SCORE
        peak = scores.amax(dim=(4, 5), keepdim=True)  # a maximum is exact in any order
        # Below EXP_FLOOR exp gives denormals, which the CPU computes dozens of times slower: exp(EXP_FLOOR) instead
        # (off by < 2e-38, against a row total of at least 1).
        weights = torch.exp((scores - peak).clamp(min=EXP_FLOOR)) * seen
    else:  # the same operations in place: each new tensor of this size costs its page faults
        scores.mul_(scaling)
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        scores.add_((seen - 1.0) * HIDDEN_SCORE)
        peak = scores.amax(dim=(4, 5), keepdim=True)
        weights = scores.sub_(peak).clamp_(min=EXP_FLOOR).exp_().mul_(seen)
    totals = weights.sum(dim=-1)  # (batch, kv_heads, group, queries, blocks)

    # Per key block, (head_dim, KEY_BLOCK) x (KEY_BLOCK, columns), then the blocks added in order.
    value_t = value.view(batch, kv_heads, blocks, KEY_BLOCK, head_dim).transpose(-1, -2)
    weights = weights.view(batch, kv_heads, columns, blocks, KEY_BLOCK).permute(0, 1, 3, 4, 2).contiguous()
    parts = torch.matmul(value_t, weights)  # (batch, kv_heads, blocks, head_dim, columns)
    out, total = parts[:, :, 0], totals[..., 0]
    for block in range(1, blocks):  # in order: the same additions whatever the padding after the row's keys
        out = out + parts[:, :, block]
        total = total + totals[..., block]
    total = total.reshape(batch, kv_heads, 1, columns)
    out = torch.where(total > 0, out / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    out = out.view(batch, kv_heads, head_dim, group, queries)[:, :, :, : heads // kv_heads]
    return out.permute(0, 1, 3, 4, 2).reshape(batch, heads, queries, head_dim).to(dtype)


def _in_blocks(keys: torch.Tensor, aligned: int) -> torch.Tensor:
    """(batch, kv_heads, n, head_dim) keys or values of any layout and dtype as one contiguous fp32 tensor of
    `aligned` rows per head, zeros after the n: the matmuls then take it without a copy of their own."""
    out = keys.new_empty((*keys.shape[:2], aligned, keys.shape[3]), dtype=torch.float32)
    out[:, :, : keys.shape[2]].copy_(keys)
    out[:, :, keys.shape[2] :].zero_()
    return out


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
