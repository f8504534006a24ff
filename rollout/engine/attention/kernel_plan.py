"""The launch plan of the Triton paged-attention kernel (`triton_attention.py`): query tiles, key slices
(split-K) and how many cache blocks each loop iteration reads. Host-side arithmetic only: no Triton here.

Tiling: a program reads `keys_per_iteration` keys (64: four 16-token blocks, their table entries loaded together)
per iteration rather than one block behind a dependent load of the block table each, and a step aims for four
programs per SM, whatever the GPU's SM count: split-K where the tiles alone are too few, in at most 16 slices of at
least 8 blocks each, so a step whose longest context is under 16 blocks is not split and may run fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.engine.kv.transfer import to_device

H100_SMS = 132  # planning without a CUDA device (the interpreter, compile checks) assumes an H100
# The most keys one product of the kernel covers: a wider cache block is read this many keys at a time (a whole block
# of 256 tokens, 256 wide in bf16, needed 557 KB of shared memory, over any GPU's).
MAX_KEY_CHUNK = 64


def next_power_of_2(value: int) -> int:
    """The smallest power of two >= value (1 for value <= 1)."""
    return 1 << max(0, value - 1).bit_length()


@dataclass(frozen=True)
class Tiling:
    """How the kernel walks a sequence's keys, and how many programs a step aims for."""

    keys_per_iteration: int = 64  # keys read per loop iteration, in whole blocks (at least one block)
    target_programs: int = 4 * H100_SMS  # programs per step split-K aims for

    def blocks_per_iter(self, block_size: int) -> int:
        """Cache blocks of `block_size` tokens per loop iteration."""
        return max(1, self.keys_per_iteration // block_size)

    @classmethod
    def for_device(cls, device: torch.device) -> Tiling:
        """The tiling for `device`: four programs per SM and 64 keys per iteration.

        Args:
            device: where the kernel runs (its SM count; an H100's off CUDA).
        """
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H100_SMS
        return cls(target_programs=4 * sms)


@dataclass
class TritonAttentionPlan:
    """Per-step launch data shared by every layer (built once by `plan`)."""

    tile_seq: torch.Tensor  # (tiles,) int32 sequence of each tile
    tile_start: torch.Tensor  # (tiles,) int32 first query offset of each tile within its sequence
    query_start: torch.Tensor  # (S + 1,) int32 packed offsets of each sequence's queries
    context: torch.Tensor  # (S,) int32 tokens cached before this step
    block_table: torch.Tensor  # (S, max_blocks) int32
    block_m: int
    block_q: int
    num_splits: int
    blocks_per_iter: int = 1  # cache blocks the kernel reads per loop iteration (Tiling)


def tile_shape(heads_per_kv: int, max_query_len: int) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_Q query tokens) of a tile: rows hold BLOCK_Q tokens x the heads of one KV head; at least
    16 rows (the smallest tl.dot), at most 64."""
    rows = max(16, next_power_of_2(heads_per_kv))
    while rows < 64 and rows // heads_per_kv < max_query_len:
        rows *= 2
    return rows, rows // heads_per_kv


def plan_splits(num_tiles: int, num_kv_heads: int, max_blocks: int, target_programs: int = 256) -> int:
    """Key-block slices per tile: enough programs to fill the GPU when few tiles have long contexts (decode), each
    slice at least 8 blocks; 1 when the tiles alone are enough. Always a power of two up to 16: NUM_SPLITS is a
    compile-time constant, so each distinct value is one more kernel for Triton to compile (at most five)."""
    programs = num_tiles * num_kv_heads
    if programs >= target_programs or max_blocks < 16:
        return 1
    most_splits = 1 << ((max_blocks // 8).bit_length() - 1)  # largest power of two <= max_blocks // 8 (slices >= 8)
    return int(min(next_power_of_2(-(-target_programs // programs)), most_splits, 16))


def plan(
    query_lens: list[int],
    contexts: list[int],
    block_table: torch.Tensor,
    heads_per_kv: int,
    num_kv_heads: int,
    block_size: int,
    device: torch.device,
    num_splits: int | None = None,
    tiling: Tiling | None = None,
) -> TritonAttentionPlan:
    """Launch data for one step.

    Args:
        query_lens: tokens computed per sequence this step.
        contexts: tokens already cached per sequence.
        block_table: (S, max_blocks) block ids.
        heads_per_kv: query heads per KV head.
        num_kv_heads: KV heads.
        block_size: tokens per cache block.
        device: where the tensors go.
        num_splits: force the number of key slices (None: `plan_splits`).
        tiling: how the kernel walks the keys and how many programs to aim for (None: `Tiling()`).
    """
    tiling = tiling or Tiling()
    block_m, block_q = tile_shape(heads_per_kv, max(query_lens))
    tiles_per_seq = [-(-length // block_q) for length in query_lens]
    tile_seq = [seq for seq, count in enumerate(tiles_per_seq) for _ in range(count)]
    tile_start = [tile * block_q for count in tiles_per_seq for tile in range(count)]
    query_start = [0]
    for length in query_lens:
        query_start.append(query_start[-1] + length)
    max_blocks = max(-(-(c + q) // block_size) for c, q in zip(contexts, query_lens))
    splits = num_splits or plan_splits(len(tile_seq), num_kv_heads, max_blocks, tiling.target_programs)

    def tensor(values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int32, device)

    return TritonAttentionPlan(
        tensor(tile_seq),
        tensor(tile_start),
        tensor(query_start),
        tensor(contexts),
        block_table.to(device=device, dtype=torch.int32),
        block_m,
        block_q,
        splits,
        tiling.blocks_per_iter(block_size),
    )
