"""CUDA graphs for decode steps: one capture per bucketed batch size, replayed with persistent input buffers.

A decode step (every sequence computes one token) has the same tensor shapes for every batch of the same size, so
its forward, hundreds of kernel launches, is captured once per bucket and replayed with one launch. The batch is
padded up to its bucket. Speculative decoding's drafted steps (each sequence computes its last token and up to
`width - 1` draft tokens) get graphs of their own (`width` > 1): every sequence takes `width` query rows, padding
tokens first (`verify_layout.py` says why), whose keys and values go to the scratch slot.

Invariants:
- A graph reads only the persistent buffers below; `run` copies the step's inputs into them before each replay.
- Every padding row is a one-token sequence at position 0 whose only block is the cache's scratch block: it writes
  its key/value there and attends only to it, so padding never touches a real sequence's cache and stays finite.
  A padding token of a drafted sequence (`width` > 1) writes to the scratch slot too (its row's `valid` is False);
  it sits before the sequence's real rows, at positions already cached, so no row reads a key past the real ones.
- The attention plan is fixed per bucket (tiles, split count); the kernel reads each row's context length from a
  buffer, so one graph serves every context up to `max_blocks_per_seq` blocks. A batch-invariant engine's graphs
  attend through `rollout.invariant`'s kernel instead, each sequence's keys walked up to its position (computed in
  the graph from the positions buffer), over the same block table.
- Weights are updated in place (`Engine.update_weights` copies into the same storage), so graphs stay valid.
- All graphs share one memory pool, captured largest first so smaller ones reuse its memory; a replay's logits are
  read (copied by the sampler) before the next replay overwrites them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from rollout.engine.attention.kernel_plan import Tiling, TritonAttentionPlan, plan_splits, tile_shape
from rollout.engine.attention.paged_metadata import PagedAttentionMetadata, SequenceGroup
from rollout.engine.kv.kv_cache import PagedKVCache
from rollout.engine.kv.transfer import to_device

logger = logging.getLogger(__name__)

# (input_ids (1, B), position_ids (1, B), metadata, rows to keep (B,)) -> logits (B, vocab)
DecodeForward = Callable[[torch.Tensor, torch.Tensor, PagedAttentionMetadata, torch.Tensor], torch.Tensor]


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: fine-grained where padding would cost the most (small batches), every 32
    sequences above 64, and `max_num_seqs` itself: padding is always under half the bucket (under a third above 64)."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64] + list(range(96, max_num_seqs, 32))
    return sorted({size for size in sizes if size < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """Captured decode forwards, one per bucket, over persistent buffers sized for the largest decode batch."""

    def __init__(
        self,
        forward: DecodeForward,
        kv_cache: PagedKVCache,
        max_batch: int,
        max_blocks_per_seq: int,
        heads_per_kv: int,
        capture: bool = True,
        tiling: Tiling | None = None,
        width: int = 1,
        batch_invariant: bool = False,
    ):
        """
        Args:
            forward: the model call of a step (the model runner's), run eagerly once per bucket, then captured.
            kv_cache: the paged cache; its scratch block takes the padding rows.
            max_batch: the largest decode batch (max_num_seqs, or max_batch_tokens when smaller).
            max_blocks_per_seq: blocks of the longest sequence (max_model_len / block_size, rounded up).
            heads_per_kv: query heads per KV head (the Triton kernel's tile layout).
            capture: False replays by running the forward eagerly on the same buffers (CPU tests of the padding and
                buffer logic; CUDA graphs need a CUDA device).
            tiling: the attention kernel's tiling (None: the default `Tiling()`).
            width: query rows per sequence: 1 for decode steps, 1 + the most draft tokens for drafted steps.
            batch_invariant: attend as `rollout.invariant` does (its Triton kernel reading the cache in place, one
                sequence a row) instead of through the Triton plan; decode steps only (`width` 1).
        """
        if batch_invariant and width != 1:
            raise ValueError("batch-invariant graphs serve decode steps only (width 1)")
        self.batch_invariant = batch_invariant
        self.tiling = tiling or Tiling()
        self.forward = forward
        self.kv_cache = kv_cache
        self.buckets = decode_buckets(max_batch)
        self.capture_enabled = capture
        self.disabled_reason: str | None = None  # set when a capture failed: decode then runs eagerly
        self.width = width
        device = kv_cache.kv.device
        size = self.buckets[-1]
        # Rows: 0 input ids, 1 positions (a sequence's first row: where the kernel starts numbering its queries).
        self._rows = torch.zeros((2, size * width), dtype=torch.long, device=device)
        self._valid = torch.ones(size * width, dtype=torch.bool, device=device)  # False: a padding token's row
        self._slots = torch.zeros(size * width, dtype=torch.long, device=device)
        self._context = torch.zeros(size, dtype=torch.int32, device=device)
        # int64 for the invariant kernel, which reads it as its table of storage blocks
        table_dtype = torch.long if batch_invariant else torch.int32
        self._block_table = torch.zeros((size, max_blocks_per_seq), dtype=table_dtype, device=device)
        self._keep = torch.arange(size * width, device=device)
        self._block_m, self._block_q = tile_shape(heads_per_kv, width)
        tiles = -(-width // self._block_q)  # per sequence
        self._tile_seq = torch.arange(size, dtype=torch.int32, device=device).repeat_interleave(tiles)
        self._tile_start = (torch.arange(size * tiles, device=device) % tiles * self._block_q).to(torch.int32)
        self._tiles_per_seq = tiles
        self._query_start = torch.arange(0, size * width + 1, width, dtype=torch.int32, device=device)
        self._max_blocks = max_blocks_per_seq
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.capture_s = 0.0  # seconds spent capturing, every bucket and every capture again after a release

    @property
    def max_batch(self) -> int:
        """The largest batch a graph serves."""
        return self.buckets[-1]

    @property
    def captured(self) -> list[int]:
        """Bucket sizes captured so far."""
        return sorted(self._graphs)

    def release(self) -> None:
        """Drop every captured graph and its memory pool (the graphs read the KV cache and the weights where they
        were at capture: after those move, each bucket is captured again when next used)."""
        self._graphs.clear()
        self._pool = torch.cuda.graph_pool_handle() if self.capture_enabled else None

    def bucket(self, batch_size: int) -> int:
        """The smallest bucket holding `batch_size` sequences."""
        return next(size for size in self.buckets if size >= batch_size)

    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture the graphs of `sizes` (default: every bucket) not captured yet, largest first. A failed capture
        (a model with host synchronisation in its forward, e.g. data-dependent MoE routing) turns graphs off with a
        warning: decode then runs eagerly, never wrongly."""
        if not self.capture_enabled or self.disabled_reason is not None:
            return
        for size in sorted(sizes or self.buckets, reverse=True):
            if size in self._graphs:
                continue
            # torch.cuda.graph switches to its capture stream and, when capture_end raises, never switches back:
            # the stream in use is restored here, or every later op of this thread would run on the capture stream.
            stream = torch.cuda.current_stream(self._rows.device)
            try:
                self._capture_one(size)
            except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager decode
                self.disabled_reason = f"{type(error).__name__}: {error}"
                self._graphs.clear()
                logger.warning("CUDA graph capture failed (%s); decode steps run eagerly", self.disabled_reason)
                return
            finally:
                torch.cuda.set_stream(stream)

    def _capture_one(self, size: int) -> None:
        started = time.perf_counter()
        try:
            self._capture_in_pool(size)
        finally:
            self.capture_s += time.perf_counter() - started

    def _capture_in_pool(self, size: int) -> None:
        with torch.cuda.device(self._rows.device):
            self._pad(0, size)  # only padding rows: capture writes nothing but the scratch block
            self._step(size)  # eager first run: Triton compiles and lazy allocations happen outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (a weight update's receiving thread) may go on meanwhile.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._step(size)
        self._graphs[size] = (graph, logits)

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        block_tables: torch.Tensor,
        device_tokens: tuple[torch.Tensor, torch.Tensor] | None = None,
        valid: list[bool] | None = None,
    ) -> torch.Tensor:
        """One step of `len(token_ids) // width` sequences (at most `max_batch`), `width` rows each. Queues copies
        and the replay; never waits for the device.

        Args:
            token_ids: each row's input token, `width` rows per sequence.
            positions: each row's position (a sequence's rows consecutive; a decode's = tokens already cached).
            block_tables: (B, n) int block ids on the host, n covering every position (entries past a sequence's
                blocks may hold anything: only blocks before the position are read).
            device_tokens: (row indices, token ids) on the device that replace those rows' `token_ids` (tokens the
                previous step sampled and the host has not seen yet).
            valid: each row's token is real (None: every one); a padding token's key and value go to the scratch
                slot and its logits row is not to be read.
        Returns:
            (B * width, vocab) logits in the model's dtype; a view of the graph's output, valid until the next `run`.
        """
        rows_given = len(token_ids)
        batch = rows_given // self.width
        size = self.bucket(batch)
        if size not in self._graphs:
            self.capture([size])  # a bucket not captured by warmup(): now, before the inputs are loaded
        pinned = self._rows.is_cuda  # pinned host memory: the copies below do not wait for the device
        rows = to_device(token_ids + positions, torch.long, "cpu").view(2, rows_given)
        self._rows[:, :rows_given].copy_(rows.pin_memory() if pinned else rows, non_blocking=True)
        if device_tokens is not None:
            self._rows[0].index_copy_(0, *device_tokens)
        if self.width > 1:
            flags = torch.tensor(valid if valid is not None else [True] * rows_given, dtype=torch.bool)
            self._valid[:rows_given].copy_(flags.pin_memory() if pinned else flags, non_blocking=True)
        tables = block_tables.to(self._block_table.dtype)  # on the host: the copy below stays asynchronous
        tables = tables.pin_memory() if pinned else tables
        self._block_table[:batch, : block_tables.shape[1]].copy_(tables, non_blocking=True)
        if batch < size:
            self._pad(batch, size)
        if size in self._graphs:
            graph, logits = self._graphs[size]
            graph.replay()
        else:
            logits = self._step(size)
        return logits[:rows_given]

    def _pad(self, start: int, end: int) -> None:
        """Make sequences [start, end) padding sequences (their slots, computed in `_step`, are the scratch slot)."""
        self._rows[:, start * self.width : end * self.width] = 0
        self._valid[start * self.width : end * self.width] = False
        self._block_table[start:end, 0] = self.kv_cache.scratch_block

    def _step(self, size: int) -> torch.Tensor:
        """The captured work: the int32 context lengths and the new tokens' cache slots from the positions, then the
        forward over `size` sequences of `width` rows."""
        width, rows = self.width, size * self.width
        positions = self._rows[1, :rows].view(size, width)
        self._context[:size].copy_(positions[:, 0])
        block_size = self.kv_cache.block_size
        blocks = self._block_table[:size].gather(1, positions // block_size)
        slots = self._slots[:rows].view(size, width)
        torch.add(positions % block_size, blocks, alpha=block_size, out=slots)
        if width > 1:  # padding tokens' keys and values go to the scratch slot
            scratch = self.kv_cache.scratch_block * block_size
            self._slots[:rows].masked_fill_(~self._valid[:rows], scratch)
        if self.batch_invariant:  # one group: every sequence one query, its cache blocks read in place
            group = SequenceGroup(self._keep[:size].view(size, 1), positions, self._block_table[:size], None)
            metadata = PagedAttentionMetadata(self.kv_cache, self._slots[:rows], [group], batch_invariant=True)
            return self.forward(self._rows[0:1, :rows], self._rows[1:2, :rows], metadata, self._keep[:rows])
        tiles = size * self._tiles_per_seq
        attention_plan = TritonAttentionPlan(
            self._tile_seq[:tiles],
            self._tile_start[:tiles],
            self._query_start[: size + 1],
            self._context[:size],
            self._block_table[:size],
            self._block_m,
            self._block_q,
            plan_splits(tiles, self.kv_cache.shape.num_kv_heads, self._max_blocks, self.tiling.target_programs),
            self.tiling.blocks_per_iter(block_size),
        )
        metadata = PagedAttentionMetadata(self.kv_cache, self._slots[:rows], [], attention_plan)
        return self.forward(self._rows[0:1, :rows], self._rows[1:2, :rows], metadata, self._keep[:rows])
