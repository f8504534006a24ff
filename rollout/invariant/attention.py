""" "rollout_invariant" attention: each query's attention computed the same way whatever the padding and the batch.

What makes ordinary attention depend on the layout: the softmax's sums and the weighted sum of values run over the
whole key axis, whose length (and the library's split of it) changes with padding, and left padding moves where a
row's keys start. Here:

- each row's keys are moved to start at its first unmasked key, then cut into blocks of `KEY_BLOCK`, so a key's
  block and its place in it depend on the row alone; padding only adds whole blocks of masked keys at the end;
- every score and every block's weighted sum of values is computed the same way whatever the number of queries and
  keys: on a GPU as matmuls of one fixed shape in a Triton kernel (tiles of `QUERY_TILE` queries); on the CPU as
  matmuls whose element arithmetic does not depend on their shape (`cpu_attention.py`);
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

from rollout.invariant.cpu_attention import KEY_BLOCK, attend_in_torch
from rollout.invariant.reductions import on_kernel_device

ATTENTION_NAME = "rollout_invariant"
QUERY_TILE = 16  # the Triton kernel's query tile (rows per program)


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
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise ValueError(
            f"{type(module).__name__} hands the batch-invariant attention a {attention_mask.dtype} mask (an additive "
            "mask of its own, as Doge's dynamic mask): only transformers' boolean masks are computed bit for bit"
        )
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
    """Batch-invariant attention (module docstring); the engine's paged attention on the CPU calls it too, with its
    keys gathered from the cache (on a GPU it calls `attend_invariant_paged`). On a GPU one Triton kernel computes it
    (`triton_attention.py`; its backward is this module's PyTorch arithmetic's), on the CPU PyTorch does.

    Args:
        query: (batch, heads, queries, head_dim).
        key, value: (batch, kv_heads, keys, head_dim).
        allowed: boolean (batch, 1, queries, keys), True where a query sees a key.
        start: (batch,) each row's first key (its first token): key blocks are counted from there; None: 0 for
            every row (the engine's gathered keys).
        scaling: the scores' scale (default head_dim ** -0.5).
        softcap: logit soft-capping, or None.
    Returns:
        (batch, heads, queries, head_dim) in `query`'s dtype (on the CPU a view of a (batch, queries, heads,
        head_dim) tensor: transposed back, it is contiguous).
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


def attend_invariant_paged(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    allowed: torch.Tensor,
    ends: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """The engine's batch-invariant attention over its paged cache on a GPU: the Triton kernel of `attend_invariant`
    reading each sequence's blocks where they are (one compiled kernel for both: the same bits as over the keys
    gathered, without gathering them).

    Args:
        query: (batch, heads, queries, head_dim).
        key_cache, value_cache: (num_blocks, block_size, kv_heads, head_dim), on the GPU.
        block_table: (batch, blocks) each sequence's blocks from its first token.
        allowed: boolean (batch or 1, 1, queries, blocks * block_size).
        ends: (batch,) each sequence's keys its queries see (its last query's position + 1): the kernel walks
            no further.
        scaling: the scores' scale.
        softcap: logit soft-capping, or None.
    Returns:
        (batch, heads, queries, head_dim) in `query`'s dtype.
    """
    from rollout.invariant.triton_attention import attend_invariant_paged_triton  # Triton only where there is a GPU

    return attend_invariant_paged_triton(
        query, key_cache, value_cache, block_table, allowed, ends, scaling, softcap, QUERY_TILE, KEY_BLOCK
    )


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
