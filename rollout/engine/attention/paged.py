"""Paged attention, registered in transformers' `AttentionInterface` as "rollout_paged".

The model is called with a packed ragged batch (`input_ids` of shape (1, total_tokens)); the step's
`PagedAttentionMetadata` (paged_metadata.py) travels to every attention layer through the forward kwargs (`rollout_metadata=`). Each
layer writes its new keys/values into the paged cache, then attends per group of sequences: decodes (one query
token each) in one padded call, prefill chunks in another, so a long prefill does not pad every decode.

Keys a sequence has not written are never read as garbage: on the PyTorch path a group's block table points past a
sequence's own blocks at the (zero) scratch block, and its own blocks hold zeros where it has not written yet
(`BlockManager.zero_new_blocks`); the Triton kernel loads no key past the last one a query can see. So a NaN left in
a block by a previous owner never meets a mask (NaN + -inf and 0 * NaN are NaN) and never reaches a new owner.

Masks honour each layer's `sliding_window` (a key is visible when q - window < k <= q, transformers' convention) and
logit soft-capping (Gemma 2). Without our metadata (a plain training or `generate` forward of the same model) the
function falls back to SDPA, or to eager attention when soft-capping is on, so the model stays usable. Inside the
engine's own model call (`engine_forward`) a missing metadata is an error instead: the model's attention did not pass
its keyword arguments through, and an unpaged attention over the packed batch would give wrong tokens silently.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rollout.engine.attention.paged_metadata import PagedAttentionMetadata
from rollout.invariant.attention import attend_invariant, attend_invariant_paged

ATTENTION_NAME = "rollout_paged"
_ENGINE_CALL = threading.local()  # `active` while this thread runs the engine's model call (`engine_forward`)


@contextlib.contextmanager
def engine_forward() -> Iterator[None]:
    """Mark the engine's model call on this thread: an attention layer called in it without the step's metadata
    raises instead of falling back to unpaged attention (a trainer's forward of the same model, on its own thread or
    outside this block, still falls back)."""
    _ENGINE_CALL.active = True
    try:
        yield
    finally:
        _ENGINE_CALL.active = False


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Masked attention with grouped KV heads. query (B, H, Q, D), key/value (B, Hkv, K, D), mask bool or additive
    (B or 1, 1, Q, K) or None (causal, bottom-right aligned). Returns (B, H, Q, D)."""
    if softcap is None:
        is_causal = mask is None and query.shape[2] > 1 and query.shape[2] == key.shape[2]
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=is_causal, enable_gqa=True
        )
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        q_len, k_len = query.shape[2], key.shape[2]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, value)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The "rollout_paged" attention function (transformers' AttentionInterface signature).

    Args:
        module: the attention module; its `layer_idx` selects the cache layer.
        query: (1, H, T, D) queries of the packed batch.
        key, value: (1, Hkv, T, D) keys/values of the new tokens.
        attention_mask: ignored on the paged path (masks come from the metadata).
        scaling: softmax scale (default 1/sqrt(D)).
        dropout: attention dropout (fallback path only).
        sliding_window: the layer's window, or None.
        softcap: attention logit soft-capping, or None.
        **kwargs: `rollout_metadata` (PagedAttentionMetadata) on the paged path; anything else is passed through.
    Returns:
        (attention output of shape (1, T, H, D), None).
    """
    metadata: PagedAttentionMetadata | None = kwargs.get("rollout_metadata")
    if metadata is None:
        if getattr(_ENGINE_CALL, "active", False):
            raise TypeError(
                f"{type(module).__name__} called its attention function without the keyword arguments its forward "
                "was given (rollout_metadata is missing): pass **kwargs through to the attention function, as "
                "transformers' own attention classes do, to run this model in rollout's engine"
            )
        return _unpaged_attention(module, query, key, value, attention_mask, scaling, dropout, softcap, **kwargs)
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by rollout_paged attention")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise TypeError(f"{type(module).__name__} has no layer_idx; paged attention needs it to find its cache layer")
    if metadata.batch_invariant:  # no linear or reduction the invariant mode routes in here: skip its per-op cost
        with torch._C.DisableTorchFunction():
            return _paged_attention(metadata, layer_idx, query, key, value, scaling, sliding_window, softcap)
    return _paged_attention(metadata, layer_idx, query, key, value, scaling, sliding_window, softcap)


# Never traced by torch.compile: functionalising the in-place cache write would copy the whole cache every step,
# and the per-step plan would become guards that recompile. The compiled forward calls it as an opaque function.
@torch.compiler.disable
def _paged_attention(
    metadata: PagedAttentionMetadata,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, None]:
    """Write the new keys/values into the paged cache, then attend over it (Triton plan or padded groups)."""
    cache = metadata.kv_cache
    cache.write(layer_idx, metadata.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    key_cache, value_cache = cache.layer(layer_idx)
    # Attention runs in the cache's dtype; under autocast (a trainer's mixed precision) the queries come in the
    # autocast dtype, and the output goes back in it.
    tokens = query[0].transpose(0, 1).to(key_cache.dtype)  # (T, H, D)
    if metadata.triton_plan is not None:
        from rollout.engine.attention.triton_kernel import paged_attention

        output = paged_attention(tokens, key_cache, value_cache, metadata.triton_plan, scaling, sliding_window, softcap)
        return output.to(query.dtype).unsqueeze(0), None
    output = torch.empty_like(tokens)
    for group in metadata.groups:
        batch, num_queries = group.query_index.shape
        group_query = tokens[group.query_index].transpose(1, 2)  # (B, H, Q, D)
        mask = group.mask(sliding_window, cache.block_size)
        # Batch-invariant: every sequence's keys start at its first token, so key block 0 starts there.
        if metadata.batch_invariant and not cache.heads_first:  # on a GPU: the kernel reads the blocks in place
            result = attend_invariant_paged(
                group_query, key_cache, value_cache, group.block_table, mask, group.key_ends(), scaling, softcap
            )
        elif metadata.batch_invariant:  # the invariant CPU attention: each head's keys as one contiguous batch
            rows = group.head_rows(key_cache.shape[1])
            group_key, group_value = (_gather_heads(c, rows, batch) for c in (key_cache, value_cache))
            result = attend_invariant(
                group_query, group_key, group_value, mask.expand(batch, -1, -1, -1), None, scaling, softcap
            )
        else:
            group_key = _gather_blocks(key_cache, group.block_table)  # (B, Hkv, L, D)
            group_value = _gather_blocks(value_cache, group.block_table)
            result = attend(group_query, group_key, group_value, mask, scaling, softcap)
        result = result.transpose(1, 2)  # (B, Q, H, D)
        targets, result = group.query_index.flatten(), result.flatten(0, 1)
        if group.valid_rows is not None:
            targets, result = targets.index_select(0, group.valid_rows), result.index_select(0, group.valid_rows)
        output.index_copy_(0, targets, result.to(output.dtype))
    return output.to(query.dtype).unsqueeze(0), None


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """(num_blocks, block_size, Hkv, D) cache + (B, n) block table -> (B, Hkv, n * block_size, D) view.
    index_select over whole blocks as rows is several times faster on CPU than advanced indexing."""
    num_blocks, block_size, heads, dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, block_table.flatten())
    return rows.view(block_table.shape[0], -1, heads, dim).transpose(1, 2)


def _gather_heads(cache: torch.Tensor, rows: torch.Tensor, batch: int) -> torch.Tensor:
    """(num_blocks, Hkv, block_size, D) heads-first cache + `SequenceGroup.head_rows` -> (B, Hkv, L, D) view of a
    copy laid out head by head, each head's (B, L, D) keys contiguous: one gather of whole (block_size * D) rows (a
    gather of blocks as (block_size, Hkv, D) then a transposing copy moves every byte twice)."""
    heads, dim = cache.shape[1], cache.shape[3]
    return cache.view(-1, cache.shape[2] * dim).index_select(0, rows).view(heads, batch, -1, dim).transpose(0, 1)


def _unpaged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    softcap: float | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A forward without our metadata (training, teacher forcing, `generate`): ordinary SDPA/eager attention."""
    if softcap is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    output = attend(query, key, value, attention_mask, scaling, softcap, dropout)
    return output.transpose(1, 2).contiguous(), None


def register_paged_attention() -> str:
    """Register "rollout_paged" (attention + SDPA-style masks for the unpaged fallback). Idempotent.

    Returns:
        The implementation name to pass to `model.set_attn_implementation`.
    """
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
