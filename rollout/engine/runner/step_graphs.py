"""The model runner's CUDA graphs (`StepGraphs`): the decode graphs and speculative decoding's verify graphs, enabled
where they can serve, captured ahead of time or per bucket when first used, dropped to be captured again when the
LoRA or MoE route hooks change, and chosen for a step that fits them (`replay`); a step that fits none runs eagerly.
"""

from __future__ import annotations

import torch

from rollout.engine.attention.kernel_plan import Tiling
from rollout.engine.kv.kv_cache import PagedKVCache
from rollout.engine.kv.transfer import to_device
from rollout.engine.runner.cuda_graphs import DecodeForward, DecodeGraphs
from rollout.engine.runner.step_inputs import StepInputs
from rollout.engine.runner.verify_layout import verify_layout
from rollout.engine.scheduling.batch import ScheduledBatch


class StepGraphs:
    """The decode graphs (`decode`) and, with speculative decoding, the verify graphs (`verify`) of one runner."""

    def __init__(
        self,
        kv_cache: PagedKVCache,
        tiling: Tiling,
        batch_invariant: bool,
        moe: bool,
        verify_width: int,
        verify_batch: int,
    ):
        """
        Args:
            kv_cache: the paged cache.
            tiling: the Triton attention kernel's tiling.
            batch_invariant: the engine's mode: its graphs attend through `rollout.invariant`'s kernels.
            moe: the model routes tokens to experts (a batch-invariant engine runs them eagerly: not capturable).
            verify_width: 1 + the most draft tokens of a drafted step (1: no speculative decoding).
            verify_batch: the largest drafted step the verify graphs serve.
        """
        self.kv_cache = kv_cache
        self.tiling = tiling
        self.batch_invariant = batch_invariant
        self.moe = moe
        self._verify_width, self._verify_batch = verify_width, verify_batch
        self.decode: DecodeGraphs | None = None
        self.verify: DecodeGraphs | None = None
        self._layout = (0, 0)  # the LoRA and route hooks' layouts the captured graphs saw

    def refusal(self, heads_per_kv: int | None) -> str | None:
        """Why no graph can serve the runner (None: they can): graphs need the Triton attention plan
        (`heads_per_kv`), or a batch-invariant engine's Triton kernels (its cache laid out for them, not the CPU's
        heads-first layout) on a dense model.

        Args:
            heads_per_kv: query heads per KV head when the Triton attention plan serves the runner, else None.
        """
        if heads_per_kv is not None:
            return None
        if not self.batch_invariant:
            return (
                "CUDA graphs need the Triton attention kernels (attention_backend 'triton', or 'auto' with triton "
                "installed and a power-of-two block_size >= 16)"
            )
        if self.kv_cache.heads_first:
            return "CUDA graphs need batch_invariant's Triton kernels: an fp32, bf16 or fp16 model on CUDA"
        if self.moe:
            return "a batch-invariant MoE model's experts read their routing back to the host: no CUDA graph holds it"
        return None

    def enable(
        self,
        decode_forward: DecodeForward,
        forward: DecodeForward,
        heads_per_kv: int | None,
        max_batch: int,
        max_model_len: int,
        capture: bool = True,
    ) -> DecodeGraphs:
        """Make the decode graphs (and the verify graphs with speculative decoding, but for a batch-invariant
        engine, whose drafted steps run eagerly). Nothing is captured yet.

        Args:
            decode_forward: the model call the decode graphs capture (maybe a torch.compile'd one).
            forward: the eager model call (the verify graphs capture it: a compiled one is for one token each).
            heads_per_kv: as `refusal`'s.
            max_batch: the largest decode batch.
            max_model_len: the longest sequence (sizes the persistent block table).
            capture: False keeps the persistent, padded buffers but runs the forward eagerly (CPU tests).
        Returns:
            The decode graphs.
        """
        max_blocks = -(-max_model_len // self.kv_cache.block_size)
        heads_per_kv = heads_per_kv or 1  # the plan's tiling (a batch-invariant engine's graphs have no plan)
        self.decode = DecodeGraphs(
            decode_forward,
            self.kv_cache,
            max_batch,
            max_blocks,
            heads_per_kv,
            capture,
            self.tiling,
            batch_invariant=self.batch_invariant,
        )
        if self._verify_width > 1 and not self.batch_invariant:
            verify_batch = min(self._verify_batch, max_batch)
            self.verify = DecodeGraphs(
                forward, self.kv_cache, verify_batch, max_blocks, heads_per_kv, capture, self.tiling, self._verify_width
            )
        return self.decode

    @property
    def hold_hooks(self) -> bool:
        """Whether the graphs capture the LoRA and route hooks (a batch-invariant engine's never replay with them:
        those steps run eagerly)."""
        return self.decode is not None and not self.batch_invariant

    def every(self) -> list[DecodeGraphs]:
        """The graphs made so far."""
        return [graphs for graphs in (self.decode, self.verify) if graphs is not None]

    def follow(self, layout: tuple[int, int]) -> None:
        """Drop every captured graph when the LoRA or route hooks' `layout` changed (captured again when used)."""
        if self._layout != layout:
            for graphs in self.every():
                graphs.release()
            self._layout = layout

    def replay(
        self, batch: ScheduledBatch, inputs: StepInputs, block_table: torch.Tensor, decode: bool, hooks: bool
    ) -> torch.Tensor | None:
        """The step's fp32 logits from a graph, or None when no graph serves it.

        Args:
            batch: the step.
            inputs: its packed inputs.
            block_table: its block tables on the host.
            decode: a pure decode step (every sequence computes one token and samples it).
            hooks: LoRA adapters are served or MoE route taps installed (the verify graphs, and a batch-invariant
                engine's graphs, hold neither: those steps run eagerly).
        """
        sequences = len(inputs.requests)
        if self.decode is not None and decode and sequences <= self.decode.max_batch:
            if not (self.batch_invariant and hooks):
                return self.decode.run(inputs.token_ids, inputs.starts, block_table, inputs.device_tokens).float()
        verify = self.verify
        if verify is not None and batch.num_draft_tokens and sequences <= verify.max_batch and not hooks:
            rows = verify_layout(batch, inputs, verify.width)
            if rows is not None:
                logits = verify.run(rows.token_ids, rows.positions, block_table, valid=rows.valid)
                return logits[to_device(rows.kept, torch.long, logits.device)].float()
        return None

    def close(self) -> None:
        """Drop every graph and its memory pool."""
        self.decode = self.verify = None
