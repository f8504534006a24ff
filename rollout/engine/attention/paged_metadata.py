"""The per-step plan of the "rollout_paged" attention (`paged.py`), built once by the model runner and shared by every
layer: where each new token's keys go in the cache (`slot_mapping`), and either the Triton kernel's launch plan or the
PyTorch path's groups of sequences (`SequenceGroup`: prefill chunks together, decodes by similar context length), each
padded to its longest member, with the block table its keys are gathered through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.engine.attention.kernel_plan import Tiling, plan
from rollout.engine.kv.kv_cache import PagedKVCache
from rollout.engine.kv.transfer import to_device
from rollout.invariant.cpu_attention import KEY_BLOCK


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
    _key_ends: torch.Tensor | None = None

    def key_ends(self) -> torch.Tensor:
        """(B,) int64 keys each sequence's queries see at most: its last query's position + 1 (a padding
        sequence's 1); built once per step."""
        if self._key_ends is None:
            self._key_ends = self.query_pos.amax(dim=1) + 1
        return self._key_ends

    def head_rows(self, kv_heads: int) -> torch.Tensor:
        """The rows of a layer's heads-first cache, viewed as (num_blocks * kv_heads, block_size * head_dim), that
        hold the group's keys laid out head by head: (kv_heads, B, blocks) flattened; built once per step."""
        if self._head_rows is None:
            heads = torch.arange(kv_heads, device=self.block_table.device)[:, None, None]
            self._head_rows = (self.block_table[None] * kv_heads + heads).flatten()
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
# Sequences computing at most this many tokens (decodes, drafted decodes of speculative decoding, short chunks) are
# grouped with the decodes by context length: padding their few queries costs less than padding their context.
_SHORT = 8


def _partition(starts: list[int], lengths: list[int], block_size: int) -> list[list[int]]:
    """Group sequences for padded attention calls: prefill chunks together, decodes (and other short sequences) by
    similar context length."""
    prefills = [i for i, length in enumerate(lengths) if length > _SHORT]
    # Longest context first; ties keep their order (sorted is stable, with reverse=True too).
    decodes = sorted((i for i, length in enumerate(lengths) if length <= _SHORT), key=starts.__getitem__, reverse=True)
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
