"""Paged attention, registered in transformers' `AttentionInterface` as "rollout_paged".

The model is called with a packed ragged batch (`input_ids` of shape (1, total_tokens)); this module's
`PagedAttentionMetadata` travels to every attention layer through the forward kwargs (`rollout_metadata=`). Each
layer writes its new keys/values into the paged cache, then attends per group of sequences: decodes (one query
token each) in one padded call, prefill chunks in another, so a long prefill does not pad every decode.

Keys a sequence has not written are never read as garbage: on the PyTorch path a group's block table points past a
sequence's own blocks at the (zero) scratch block, and its own blocks hold zeros where it has not written yet
(`BlockManager.zero_new_blocks`); the Triton kernel loads no key past the last one a query can see. So a NaN left in
a block by a previous owner never meets a mask (NaN + -inf and 0 * NaN are NaN) and never reaches a new owner.

Masks honour each layer's `sliding_window` (a key is visible when q - window < k <= q, transformers' convention) and
logit soft-capping (Gemma 2). Without our metadata (a plain training or `generate` forward of the same model) the
function falls back to SDPA, or to eager attention when soft-capping is on, so the model stays usable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rollout.engine.attention.kernel_plan import Tiling, plan
from rollout.engine.kv.kv_cache import PagedKVCache
from rollout.engine.kv.transfer import to_device
from rollout.invariant.attention import attend_invariant
from rollout.invariant.cpu_attention import KEY_BLOCK
from rollout.invariant.reductions import on_kernel_device

ATTENTION_NAME = "rollout_paged"


@dataclass
class SequenceGroup:
    """A padded sub-batch of sequences: B sequences, up to Q query tokens each, up to L cached keys each."""

    query_index: torch.Tensor  # (B, Q) positions in the packed batch (padding points at 0)
    query_pos: torch.Tensor  # (B, Q) absolute positions (padding: 0, so its mask row is never empty)
    block_table: torch.Tensor  # (B, num_blocks) device block ids, padded with the scratch block
    # Flat (B * Q) rows of the real queries, None when there is no padding: a gather by index, not a boolean mask
    # (which would read the mask's true count back to the host).
    valid_rows: torch.Tensor | None
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _head_rows: torch.Tensor | None = None

    def head_rows(self, block_size: int, kv_heads: int) -> torch.Tensor:
        """The cache rows (one per token and KV head, in a layer's (num_blocks * block_size * kv_heads, head_dim)
        view) of every key of the group laid out head by head, (kv_heads, B, L) flattened; built once per step."""
        if self._head_rows is None:
            tokens = torch.arange(block_size, device=self.block_table.device)
            slots = (self.block_table[:, :, None] * block_size + tokens).flatten(1)  # (B, L)
            heads = torch.arange(kv_heads, device=slots.device)[:, None, None]
            self._head_rows = (slots[None] * kv_heads + heads).flatten()
        return self._head_rows

    def mask(self, sliding_window: int | None, block_size: int) -> torch.Tensor:
        """Boolean (B, 1, Q, L) mask, True where attention is allowed; built once per step per window size."""
        if sliding_window not in self._masks:
            length = self.block_table.shape[1] * block_size
            key_pos = torch.arange(length, device=self.query_pos.device)
            query_pos = self.query_pos.unsqueeze(-1)
            allowed = key_pos <= query_pos
            if sliding_window is not None:
                allowed &= key_pos > query_pos - sliding_window
            self._masks[sliding_window] = allowed.unsqueeze(1)
        return self._masks[sliding_window]


@dataclass
class PagedAttentionMetadata:
    """Per-step tensors shared by every layer; built once by the model runner."""

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # (T,) flat cache slot of every new token
    groups: list[SequenceGroup]
    # Launch data of the Triton kernel, when it serves this step (then `groups` is empty).
    triton_plan: Any = None
    # Attend as `rollout.invariant` does (fixed key blocks from each sequence's first token), not through SDPA.
    batch_invariant: bool = False

    @classmethod
    def build(
        cls,
        kv_cache: PagedKVCache,
        starts: list[int],
        lengths: list[int],
        block_table: torch.Tensor,
        device: torch.device,
        heads_per_kv: int | None = None,
        tiling: Tiling | None = None,
        batch_invariant: bool = False,
    ) -> tuple[PagedAttentionMetadata, torch.Tensor]:
        """Turn per-sequence (start, length, blocks) into attention metadata and position ids.

        Args:
            kv_cache: the cache the layers read and write.
            starts: first position computed for each sequence (= tokens already cached).
            lengths: tokens computed for each sequence this step.
            block_table: (S, max_blocks) block ids, padded with 0.
            device: where the tensors go.
            heads_per_kv: query heads per KV head when the Triton kernel serves the step; None for PyTorch.
            tiling: the Triton kernel's tiling (None: the default `Tiling()`).
            batch_invariant: attend as `rollout.invariant` does; each group's block table is then padded with the
                scratch block (zeros, masked) to whole key blocks, so that the keys are read where they are gathered.
        Returns:
            (metadata, position_ids of shape (T,)).
        """
        block_size = kv_cache.block_size
        starts_t = to_device(starts, torch.long, device)
        lengths_t = to_device(lengths, torch.long, device)
        block_table = to_device(block_table, torch.long, device)
        # output_size given: repeat_interleave on CUDA would otherwise read the total back to the host.
        seq_of_token = torch.repeat_interleave(
            torch.arange(len(lengths), device=device), lengths_t, output_size=sum(lengths)
        )
        token_offset = torch.cumsum(lengths_t, 0) - lengths_t  # first packed index of each sequence
        positions = starts_t[seq_of_token] + torch.arange(len(seq_of_token), device=device) - token_offset[seq_of_token]
        slots = block_table[seq_of_token, positions // block_size] * block_size + positions % block_size
        if heads_per_kv is not None:
            num_kv_heads = kv_cache.shape.num_kv_heads
            triton_plan = plan(
                lengths, starts, block_table, heads_per_kv, num_kv_heads, block_size, device, None, tiling
            )
            return cls(kv_cache, slots, [], triton_plan), positions
        groups = []
        for members in _partition(starts, lengths, block_size):
            index = to_device(members, torch.long, device)
            group_lengths, group_starts = lengths_t[index], starts_t[index]
            max_query = max(lengths[i] for i in members)
            max_blocks = max(-(-(starts[i] + lengths[i]) // block_size) for i in members)
            offsets = torch.arange(max_query, device=device)
            valid = offsets < group_lengths.unsqueeze(1)
            query_index = torch.where(valid, token_offset[index].unsqueeze(1) + offsets, 0)
            query_pos = torch.where(valid, group_starts.unsqueeze(1) + offsets, 0)
            valid_rows = None
            if any(lengths[i] != max_query for i in members):
                rows = [row * max_query + q for row, i in enumerate(members) for q in range(lengths[i])]
                valid_rows = to_device(rows, torch.long, device)
            table = block_table[index, :max_blocks]
            if any(-(-(starts[i] + lengths[i]) // block_size) != max_blocks for i in members):
                # Entries past a sequence's own blocks are stale ids (other owners' blocks, maybe holding NaN): they
                # read the scratch block instead, which nothing writes on this path (decode graphs need Triton).
                live = (group_starts + group_lengths + block_size - 1) // block_size
                padding = torch.arange(max_blocks, device=device) >= live.unsqueeze(1)
                table = table.masked_fill(padding, kv_cache.scratch_block)
            if batch_invariant and KEY_BLOCK % block_size == 0:
                whole = (-max_blocks) % (KEY_BLOCK // block_size)
                table = torch.nn.functional.pad(table, (0, whole), value=kv_cache.scratch_block)
            groups.append(SequenceGroup(query_index, query_pos, table, valid_rows))
        return cls(kv_cache, slots, groups, batch_invariant=batch_invariant), positions


# A decode group is split when a sequence needs less than this fraction of the group's longest context, and the
# group already holds enough sequences to be worth a separate attention call: padding to the longest context costs
# memory traffic in every layer, each extra group costs a few kernel launches.
_SPLIT_FRACTION = 0.75
_MIN_GROUP = 6


def _partition(starts: list[int], lengths: list[int], block_size: int) -> list[list[int]]:
    """Group sequences for padded attention calls: prefill chunks together, decodes by similar context length."""
    prefills = [i for i, length in enumerate(lengths) if length > 1]
    # Longest context first; ties keep their order (sorted is stable, with reverse=True too).
    decodes = sorted((i for i, length in enumerate(lengths) if length == 1), key=starts.__getitem__, reverse=True)
    groups = [prefills] if prefills else []
    current: list[int] = []
    for i in decodes:
        if len(current) >= _MIN_GROUP and starts[i] + 1 < _SPLIT_FRACTION * (starts[current[0]] + 1):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


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
        if metadata.batch_invariant and not on_kernel_device(key_cache):  # each head's keys as one contiguous batch
            rows = group.head_rows(cache.block_size, key_cache.shape[2])
            group_key, group_value = (_gather_heads(c, rows, batch) for c in (key_cache, value_cache))
        else:
            group_key = _gather_blocks(key_cache, group.block_table)  # (B, Hkv, L, D)
            group_value = _gather_blocks(value_cache, group.block_table)
        mask = group.mask(sliding_window, cache.block_size)
        if metadata.batch_invariant:  # every sequence's keys start at its first token: block 0 starts there
            result = attend_invariant(
                group_query, group_key, group_value, mask.expand(batch, -1, -1, -1), None, scaling, softcap
            )
        else:
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
    """(num_blocks, block_size, Hkv, D) cache + `SequenceGroup.head_rows` -> (B, Hkv, L, D) view of a copy laid out
    head by head, each head's (B, L, D) keys contiguous: one gather of (head_dim)-long rows (a gather of whole blocks
    then a transposing copy moves every byte twice)."""
    heads, dim = cache.shape[2], cache.shape[3]
    return cache.reshape(-1, dim).index_select(0, rows).view(heads, batch, -1, dim).transpose(0, 1)


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
