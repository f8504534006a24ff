"""ScheduledBatch -> tensors -> model forward -> logits of the sampled positions. Owns every tensor of a step."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from rollout.config import ContinuousBatchingConfig, FieldError
from rollout.engine.attention.kernel_plan import Tiling
from rollout.engine.attention.paged import ATTENTION_NAME
from rollout.engine.attention.paged_metadata import PagedAttentionMetadata
from rollout.engine.kv.block_tables import BlockTables
from rollout.engine.kv.kv_cache import PagedKVCache
from rollout.engine.kv.transfer import to_device
from rollout.engine.lora.adapter_table import AdapterTable
from rollout.engine.moe.router_taps import engine_step
from rollout.engine.moe.routes import PendingRoutes, RouteRecorder, find_routers, plan_route_rows
from rollout.engine.requests.request import Request
from rollout.engine.runner.cuda_graphs import DecodeForward, DecodeGraphs
from rollout.engine.runner.model_checks import resolve_attention_backend, text_config
from rollout.engine.runner.model_forward import ModelForward
from rollout.engine.runner.model_lease import INVARIANT_EXPERTS, SYNC_FREE_EXPERTS, ModelHold, acquire, check_lease
from rollout.engine.runner.step_graphs import StepGraphs
from rollout.engine.runner.step_inputs import UnresolvedTokens, logits_rows, step_inputs
from rollout.engine.sampling.fp32_head import Fp32Head, projection_of
from rollout.engine.sampling.prompt_logprobs import PendingPromptLogprobs, PromptScorer, plan_prompt_rows
from rollout.engine.scheduling.batch import ScheduledBatch
from rollout.invariant.model_support import refuse_variant_model


class ModelRunner:
    """Runs an unmodified transformers causal LM over packed ragged batches with the paged cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        config: ContinuousBatchingConfig | None = None,
        max_model_len: int = 1 << 16,
    ):
        """
        Args:
            model: a transformers causal LM; its attention implementation is switched to "rollout_paged", which
                still serves ordinary (unpaged) forwards through SDPA/eager.
            kv_cache: the paged cache the attention layers read and write.
            config: the engine settings this runner reads: attention_backend, fp32_logits, use_cuda_graph,
                decode_compile_config and max_num_seqs (defaults if None).
            max_model_len: the longest sequence the engine accepts (sizes the decode graphs' block table).
        Raises:
            ValueError: "triton" asked for where it cannot run (not installed, or a block size it cannot serve),
                CUDA graphs asked for without the Triton kernels, an MoE model held by an engine whose
                batch_invariant differs, or with batch_invariant a model the mode cannot make bit for bit.
        """
        config = config or ContinuousBatchingConfig()
        # An MoE model's experts: sync-free while lent, or one F.linear each, which the invariant mode tiles.
        self._experts = INVARIANT_EXPERTS if config.batch_invariant else SYNC_FREE_EXPERTS
        if config.batch_invariant:
            refuse_variant_model(model, max_model_len)
        check_lease(model, self._experts)
        self.model = model
        self.kv_cache = kv_cache
        self.block_tables = BlockTables()
        backend = "torch" if config.batch_invariant else config.attention_backend
        self.heads_per_kv = resolve_attention_backend(model, kv_cache, backend)
        self.batch_invariant = config.batch_invariant
        self.tiling = Tiling.for_device(kv_cache.kv.device)
        self.device = next(model.parameters()).device
        self._closed = False
        self.fp32_head: Fp32Head | None = None  # with fp32_logits (fp32_head.py)
        self._suspended = False  # the model was given back by suspend()
        # The model call is an object of its own, not a bound method: the decode graphs and the compiled forward
        # keep it, and a reference back to this runner would put the runner (the cache, the graphs) in a cycle that
        # only a garbage collection frees.
        # With fp32_logits the output projection runs in fp32 in this runner's forwards (its hook is added last).
        head = projection_of(model) if config.fp32_logits else None
        head_fp32 = head is not None and head.weight.dtype != torch.float32
        # LoRA adapters served unmerged (lora.py): no hook until the first adapter arrives; an adapter's copy of the
        # head is computed as the base head is (fp32 or not).
        max_tokens = max(config.max_batch_tokens, config.max_num_seqs)
        self.adapters = AdapterTable(
            model, config.max_loras, config.max_lora_rank, max_tokens, head_fp32, config.batch_invariant
        )
        self._forward: DecodeForward = ModelForward(model, self.device, self.adapters, config.batch_invariant)
        self._decode_forward: DecodeForward = self._forward
        if config.decode_compile_config is not None:
            self._decode_forward = torch.compile(self._forward, **config.decode_compile_config.to_dict())
        # Decode graphs; speculative decoding's drafted steps get graphs of their own, 1 + num_speculative_tokens rows
        # a sequence.
        self.graphs = StepGraphs(
            kv_cache,
            self.tiling,
            config.batch_invariant,
            bool(find_routers(model)),
            1 + config.num_speculative_tokens if config.speculative else 1,
            min(config.speculative_disable_by_batch_size, config.max_num_seqs),
        )
        # use_cuda_graph None (auto): on CUDA wherever graphs can serve; True insists on it.
        if config.use_cuda_graph and self.device.type != "cuda":
            raise FieldError("use_cuda_graph", f"True needs a CUDA device (the model is on {self.device.type})")
        if self.device.type == "cuda" and config.use_cuda_graph is not False:
            refusal = self.graphs.refusal(self.heads_per_kv)
            if refusal is None:
                self.enable_decode_graphs(min(config.max_num_seqs, config.max_batch_tokens), max_model_len)
            elif config.use_cuda_graph:
                raise FieldError("use_cuda_graph", refusal)
        # Last, once nothing above can fail: a runner that was not built leaves the model as it found it.
        # The fp32 head's hook stays put for the runner's life (one added per call would invalidate compiled code)
        # and acts only inside a step; it is registered before any adapter's saved head (saved_head.py runs after).
        if head is not None:  # an fp32 head too: under a trainer's autocast its product is computed in bf16
            self.fp32_head = Fp32Head(head, config.batch_invariant)
        # Prompt log-probs of the last step run (prompt_logprobs.py), for the engine to deliver when it resolves it.
        self.prompt_scorer = PromptScorer(model, text_config(model), self.adapters.state, config.batch_invariant)
        self.prompt_results: PendingPromptLogprobs | None = None
        # MoE routes (routes.py): no hook until the first request that asks; the last step's, for the engine.
        self.routes = RouteRecorder(
            model, max(config.max_batch_tokens, config.max_num_seqs), kv_cache.block_size, kv_cache.num_blocks
        )
        self.route_results: PendingRoutes | None = None
        # What the runner put on the model, given back by close(); a runner dropped unclosed (an Engine never closed,
        # a manager never stopped) gives it back when it is freed, through a finalizer that holds `_hold`, not the
        # runner: the model kept the paged attention, eval mode and the fp32 head's copy and hook for good otherwise.
        parts = [self.fp32_head, self.prompt_scorer, self.adapters, self.routes]
        self._hold = ModelHold([part for part in parts if part is not None])
        self._hold.leased = acquire(model, self._experts)  # what release() gives back (a peft model's base)
        self._finalizer = weakref.finalize(self, self._hold.give_back)
        self._finalizer.atexit = False

    def routes_refusal(self) -> str | None:
        """Why this runner cannot record MoE routes (None: it can)."""
        reason = self.routes.refusal()
        if reason is not None:
            return reason
        if self._decode_forward is not self._forward:
            return "not recorded through a torch.compile'd decode forward: leave decode_compile_config unset"
        return None

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """The decode graphs (None: decode steps run eagerly)."""
        return self.graphs.decode

    @property
    def verify_graphs(self) -> DecodeGraphs | None:
        """Speculative decoding's verify graphs (None: drafted steps run eagerly)."""
        return self.graphs.verify

    def enable_decode_graphs(self, max_batch: int, max_model_len: int, capture: bool = True) -> DecodeGraphs:
        """Serve decode steps of up to `max_batch` sequences through `DecodeGraphs` (the engine does this on CUDA
        when `use_cuda_graph` allows; graphs are captured lazily per bucket, or all at once by `capture_graphs`).

        Args:
            max_batch: the largest decode batch.
            max_model_len: the longest sequence (sizes the persistent block table).
            capture: False keeps the persistent, padded buffers but runs the forward eagerly (CPU tests).
        Raises:
            FieldError: no graph can serve this runner (named `use_cuda_graph`).
        """
        refusal = self.graphs.refusal(self.heads_per_kv)
        if refusal is not None:
            raise FieldError("use_cuda_graph", refusal)
        return self.graphs.enable(
            self._decode_forward, self._forward, self.heads_per_kv, max_batch, max_model_len, capture
        )

    def capture_graphs(self) -> None:
        """Capture every decode bucket, and every verify bucket with speculative decoding, now (no-op without
        graphs)."""
        for graphs in self.graphs.every():
            with torch.inference_mode(), self._stepping():
                graphs.capture()

    @contextlib.contextmanager
    def _stepping(self, batch: ScheduledBatch | None = None) -> Iterator[None]:
        """Inside: the fp32 head (if any) projects, from an up-to-date copy of the head's weight, and the LoRA hooks
        (if any adapter is served) act for `batch`'s sequences (None: a graph capture, every token on the base)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(engine_step())  # a trainer's routing replay leaves the engine's forwards alone
            if self.adapters.loaded:  # the one check a step makes when no adapter is served
                sequences = batch.sequences if batch is not None else []
                adapters = [seq.request.adapter for seq in sequences]
                lengths = [seq.num_tokens for seq in sequences]
                stack.enter_context(self.adapters.stepping(adapters, lengths, self.graphs.hold_hooks))
            if self.routes.installed:
                sequences = batch.sequences if batch is not None else []
                wanted = any(seq.request.routes is not None for seq in sequences)
                tokens = sum(seq.num_tokens for seq in sequences)
                stack.enter_context(self.routes.recording(tokens, wanted, self.graphs.hold_hooks))
            if self.fp32_head is not None:
                self.fp32_head.refresh_if_changed(projection_of(self.model))
                self.fp32_head.active = True
                stack.callback(setattr, self.fp32_head, "active", False)
            yield

    def weights_changed(self) -> None:
        """The model's weights may have changed in place (a weight update, a trainer's step, a paused manager's
        user): refresh what the runner derives from them (the fp32 head's copy, in place: graphs stay valid)."""
        if self.fp32_head is not None:
            self.fp32_head.refresh(projection_of(self.model))

    def close(self) -> None:
        """Release the model (the last runner to close gives it back its attention implementation and training
        mode), the decode graphs and their memory pool, and the compiled forward. Idempotent."""
        if not self._closed:
            self._closed = True
            self._finalizer.detach()
            self._hold.close_parts()  # the fp32 head, the prompt scorer, the adapters' and routes' hooks
            self.graphs.close()  # frees the graphs and their memory pools
            self._decode_forward = self._forward  # a compiled forward holds its graphs and guards
            self._hold.release_lease()

    @property
    def closed(self) -> bool:
        """True once `close()` ran."""
        return self._closed

    def release(self, request: Request) -> None:
        """Forget a finished request (its block-table row goes back)."""
        self.block_tables.release(request)

    def suspend(self) -> None:
        """Give the model back between uses (attention implementation, training mode) while keeping the KV cache
        and CUDA graphs; `resume()` takes it again. Idempotent."""
        if not self._closed and not self._suspended:
            self._suspended = True
            self._hold.release_lease()

    def resume(self) -> None:
        """Take the model again after `suspend()` (paged attention, eval mode).

        Raises:
            ValueError: another engine holds the MoE model meanwhile with another `batch_invariant` (the runner stays
                suspended, holding nothing).
            RuntimeError: the runner is closed (a closed runner never takes the model again: nothing would give it
                back).
        """
        if self._closed:
            raise RuntimeError("this engine is closed: it cannot take the model again; build a new one")
        if self._suspended:
            self._hold.leased = acquire(self.model, self._experts)  # first: a refusal leaves the runner suspended
            self._suspended = False
            self.weights_changed()  # the caller may have trained or reloaded the model meanwhile

    def run(self, batch: ScheduledBatch, unresolved: UnresolvedTokens | None = None) -> torch.Tensor:
        """Queue the step's block moves, then the forward, without waiting for the device.

        Args:
            batch: the step.
            unresolved: the previous step's sampled tokens, when they are not on the host yet (overlapped
                scheduling): a sequence whose input ends with a placeholder reads its token from there.
        Returns:
            fp32 logits of shape (batch.next_row, vocab), one row per sequence that reached its end (a drafted
            sequence: 1 + len(draft) rows, its last token's and each draft token's).
            A step that scores prompt positions (`SamplingParams.prompt_logprobs`) leaves them in `prompt_results`.
        Raises:
            RuntimeError: an input token is a placeholder that `unresolved` does not cover.
        """
        self.prompt_results = self.route_results = None
        with torch.inference_mode(), self._stepping(batch):
            logits = self._run(batch, unresolved)
            if self.routes.installed:
                self.route_results = self.routes.collect(plan_route_rows(batch), batch.num_tokens)
            return logits

    def _run(self, batch: ScheduledBatch, unresolved: UnresolvedTokens | None) -> torch.Tensor:
        if self.model.config._attn_implementation != ATTENTION_NAME:
            raise RuntimeError(
                f"the model's attention implementation was changed to {self.model.config._attn_implementation!r} "
                "while an engine is using it"
            )
        # 1. Block moves, in an order that never reads a block after it was overwritten.
        self.move_blocks(batch)
        # 2. One pass over the step's requests: input ids (placeholders read on the device), block tables.
        inputs = step_inputs(batch, unresolved, self.device)
        block_table = self.block_tables.gather(inputs.requests)
        # 3. A pure decode step (every sequence computes one token and samples it) of a captured size replays its
        # CUDA graph; a drafted step a verify graph.
        decode = inputs.one_token_each and len(batch.logits_sequences) == len(inputs.requests)
        if self.graphs.decode is not None:
            self.graphs.follow((self.adapters.layout_version, self.routes.layout_version))
            hooks = self.adapters.loaded or self.routes.installed
            logits = self.graphs.replay(batch, inputs, block_table, decode, hooks)
            if logits is not None:
                return logits
        # 4. Packed inputs: O(new tokens + blocks) host work, nothing per cached token.
        lengths = [seq.num_tokens for seq in batch.sequences]
        metadata, positions = PagedAttentionMetadata.build(
            self.kv_cache,
            inputs.starts,
            lengths,
            block_table,
            self.device,
            self.heads_per_kv,
            self.tiling,
            self.batch_invariant,
        )
        keep = to_device(logits_rows(batch, lengths), torch.long, self.device)
        # 5. Forward; logits only at the positions that get sampled.
        forward = self._decode_forward if decode else self._forward
        input_tensor = to_device(inputs.token_ids, torch.long, self.device)
        if inputs.device_tokens is not None:
            input_tensor.index_copy_(0, *inputs.device_tokens)
        args = (input_tensor.unsqueeze(0), positions.unsqueeze(0), metadata, keep)
        plan = None if decode else plan_prompt_rows(batch)  # a decode step never scores prompt positions
        if plan is None:
            return forward(*args).float()
        logits, self.prompt_results = self.prompt_scorer.run(forward, args, plan)
        return logits.float()

    def move_blocks(self, batch: ScheduledBatch) -> None:
        """Queue the step's swap-outs, zeroing of stale blocks, swap-ins and copy-on-write copies, in that order
        (`run` does it first; a step that computes nothing needs it alone)."""
        self.kv_cache.swap_out(batch.swap_out)
        self.kv_cache.zero_blocks(batch.zero_blocks)
        self.kv_cache.swap_in(batch.swap_in)
        self.kv_cache.copy_blocks(batch.block_copies)
