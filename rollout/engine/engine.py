"""The engine: requests in, per-step outputs out. Single-threaded; the manager drives it.

It holds the parts a step passes through (scheduler, model runner, sampler, KV cache), its `StepLoop` (schedule ->
run -> sample -> update, with the step in flight under overlapped scheduling) and its `WeightUpdates` (weights and
adapters committed between two steps). Anything that changes requests or weights from outside the loop (`cancel`,
`update_weights`, `close`) first drains the step in flight, so it always sees resolved tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.config import FieldError, SamplingParams
from rollout.engine.counters import StepCounters, engine_stats, log_leaks
from rollout.engine.kv.kv_cache import PagedKVCache
from rollout.engine.requests.group_spec import GroupSpec
from rollout.engine.requests.intake import RequestIntake
from rollout.engine.requests.outputs import GenerationOutput
from rollout.engine.requests.request import Request, sample_id
from rollout.engine.runner.model_checks import media_placeholder_tokens, servable_text_config
from rollout.engine.runner.model_context import served_model_len
from rollout.engine.runner.model_runner import ModelRunner
from rollout.engine.sampling.sampler import Sampler
from rollout.engine.scheduling.block_manager import BlockManager
from rollout.engine.scheduling.scheduler import Scheduler
from rollout.engine.speculative.drafter import SuffixDrafter
from rollout.engine.step_loop import StepLoop
from rollout.engine.warmup import warm_up
from rollout.engine.weights.engine_weights import EngineWeights
from rollout.engine.weights.weight_table import WeightTable
from rollout.engine.weights.weight_updates import WeightUpdates
from rollout.generation_config import resolve as resolve_generation_config
from rollout.invariant.cpu_check import check_cpu_products
from rollout.invariant.reductions import on_kernel_device
from rollout.transformers_configs import engine_config


class Engine(EngineWeights):
    """Continuous-batching engine over one transformers model: requests in, per-step outputs out."""

    def __init__(
        self, model: torch.nn.Module, config: Any = None, generation_config: Any = None, tokenizer: Any = None
    ):
        """
        Args:
            model: a transformers causal LM (any decoder-only model whose attention uses AttentionInterface).
            config: engine settings: rollout's ContinuousBatchingConfig, transformers' (converted field by field by
                `rollout.transformers_configs`, refusing by name what rollout cannot honour), or None (defaults).
            generation_config: a `transformers.GenerationConfig` with default sampling settings; fields it leaves
                unset come from `model.generation_config`, then from transformers' global defaults, as in `generate`.
            tokenizer: the model's tokenizer, for stop strings (`SamplingParams.stop`); None refuses them.
        Raises:
            FieldError: a model the engine cannot serve or a setting it cannot honour (named; "batch_invariant" on a
                CPU whose matmuls are not row-invariant for the model's shapes), or a KV cache that does not fit
                the device's free memory ("num_blocks").
        """
        model_config = servable_text_config(model)
        self.vocab_size = model_config.vocab_size
        defaults = resolve_generation_config(
            generation_config, getattr(model, "generation_config", None), self.vocab_size
        )
        self.config = engine_config(config if config is not None else defaults.continuous_batching_config)
        self.model = model
        self.max_model_len = served_model_len(model, self.config.max_model_len)
        parameter = next(model.parameters())
        if self.config.batch_invariant:  # on the CPU, before anything is allocated
            check_cpu_products(model)
        # The invariant CPU attention reads one KV head's keys at a time (the Triton kernels read blocks as stored).
        heads_first = self.config.batch_invariant and not on_kernel_device(parameter)
        self.kv_cache = PagedKVCache.for_model(model, self.config, self.max_model_len, heads_first)
        self.block_manager = BlockManager(
            self.kv_cache.num_blocks, self.config.block_size, self.config.allow_block_sharing,
            self.kv_cache.num_swap_blocks,
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.block_manager, self.config.max_batch_tokens, self.config.max_num_seqs, self.config.scheduler_type
        )
        self.runner = ModelRunner(model, self.kv_cache, self.config, self.max_model_len)
        try:  # the runner took the model: a construction that fails past here gives it back
            # PyTorch attention reads whole blocks
            self.block_manager.zero_new_blocks = self.runner.heads_per_kv is None
            self.block_manager.routed = self.runner.routes.cache  # cached blocks whose MoE routes are known
            self.sampler = Sampler(self.vocab_size, parameter.device, self.config.batch_invariant)
            if self.runner.decode_graphs is not None:  # where decode steps replay graphs, sampling passes do too
                self.sampler.enable_graphs(self.runner.decode_graphs.buckets)
            overlap = self.config.overlap_scheduling
            overlap = parameter.device.type == "cuda" if overlap is None else overlap
            self.loop = StepLoop(self.scheduler, self.runner, self.sampler, overlap, self.config.return_logprobs)
            if self.config.speculative == "suffix":
                self.scheduler.drafter = SuffixDrafter(
                    self.config.num_speculative_tokens,
                    self.config.speculative_disable_by_batch_size,
                    self.config.speculative_index_tokens,
                )
                self.loop.clear_drafts_on_update = self.config.speculative_clear_on_weight_update
            self.counters: StepCounters = self.loop.counters
            self.warmed_up = False  # warmup() ran
            self.intake = RequestIntake(
                self.vocab_size,
                self.max_model_len,
                self.config,
                defaults,
                tokenizer,
                self.runner.adapters.ref,
                routes_refusal=self.runner.routes_refusal(),
                media_tokens=media_placeholder_tokens(model),
            )
            self.weight_table = WeightTable(model)
            self.weight_updates = WeightUpdates(self.loop, self.runner, self.weight_table)
        except BaseException:
            self.runner.close()  # the model's attention implementation, training mode and hooks, as they were
            self.kv_cache.release()
            raise

    # ---- requests ---------------------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request made by `intake.prepare` (`RequestIntake`).

        Raises:
            ValueError: its group id is still running, or it asks for prompt_logprobs this model cannot give.
            AdapterUnloaded: its adapter is no longer the one served under its name.
        """
        if self.kv_cache.is_released and self.runner.closed:
            raise RuntimeError("this engine is closed: its KV cache and graphs were freed; build a new one")
        if request.group_id in self.loop.open_groups:  # checked first: the admissions below may install taps
            raise FieldError("group_id", f"{request.group_id!r} is already running")
        if request.adapter is not None:  # looked up at intake, maybe on another thread: still the one served?
            self.runner.adapters.check_served(request.adapter)
        self.runner.prompt_scorer.admit(request)  # prompt_logprobs on a model known not to give them: refused
        self.runner.routes.admit(request)  # return_routes on a dense model: refused
        self.loop.add(request)

    def add_request(
        self,
        group_id: str,
        prompt_ids: Any,
        sampling: SamplingParams | None = None,
        n: int | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        adapter: str | None = None,
    ) -> list[str]:
        """Queue a group of `n` samples of one prompt; the prompt is prefilled once and shared.

        Args:
            group_id: unique id of the group (must not be running already).
            prompt_ids: prompt token ids (a list, or a 1-D / (1, L) tensor or array).
            sampling: a SamplingParams (copied; None fields from the generation config) or a dict of its fields.
            n: samples in the group (None: the GenerationConfig's num_return_sequences, else 1).
            max_new_tokens: the length (refused when `sampling.max_new_tokens` gives another).
            streaming: emit a delta after every token (else one output per sample when it finishes).
            record_timestamps: outputs carry the time each token reached the host.
            adapter: a LoRA adapter `load_adapter` loaded; None: the base model.
        Returns:
            The request ids of the n samples.
        Raises:
            ValueError: bad input (names the field).
        """
        spec = GroupSpec(group_id, prompt_ids, sampling, n, max_new_tokens, streaming, record_timestamps, adapter)
        request = self.intake.prepare(spec)
        self.submit(request)
        return [request.request_id] + [sample_id(group_id, i) for i in range(1, request.num_forks + 1)]

    def cancel(self, *group_ids: str) -> list[GenerationOutput]:
        """Abort every unfinished sample of these groups (unknown or finished ids are ignored). Many groups at once
        cost one pass over the queues, not one per group.

        Args:
            group_ids: the groups to end.
        Returns:
            Their outputs of the step in flight (finished first), then the final outputs of their aborted samples
                (finish_reason "abort"). Other groups' outputs of that step come with the next `step()`.
        """
        return self.loop.cancel(*group_ids)

    @property
    def num_blocks(self) -> int:
        """KV cache blocks (of `config.block_size` tokens each) on the device."""
        return self.block_manager.num_blocks

    def open_group_ids(self) -> list[str]:
        """Groups queued or running (not every sample finished yet)."""
        return list(self.loop.open_groups)

    @property
    def num_waiting(self) -> int:
        """Requests queued (or preempted) that wait for admission."""
        return self.scheduler.num_waiting

    def pause_admission(self) -> None:
        """Admit no request that has not sampled yet (a "wait" weight update drains what runs)."""
        self.scheduler.pause_admission()

    def resume_admission(self) -> None:
        """Admit requests again."""
        self.scheduler.resume_admission()

    def stats(self) -> dict[str, Any]:
        """The engine's counters, a snapshot (`engine_stats`)."""
        return engine_stats(self)

    def warmup(self, num_tokens: int = 8) -> None:
        """Capture the decode CUDA graphs and run one short request, leaving no trace (`warm_up`). Call it while
        the engine is idle.

        Args:
            num_tokens: length of the warm-up prompt.
        """
        warm_up(self, num_tokens)

    def has_unfinished(self) -> bool:
        """True while any request is queued or running, or outputs wait to be returned by `step()`."""
        return self.loop.has_unfinished()

    def close(self) -> None:
        """Abort what is left, give the model back its attention implementation, and free the KV cache, the swap
        space and the decode graphs at once (on CUDA their cached blocks go back to the device), whoever still
        holds this engine (and the grammars' buffers and compile caches). Outputs not returned yet are dropped
        (call `flush()` first to get them). Idempotent."""
        self.loop.end_all()
        log_leaks(self)  # every request ended: a block, slot or row still held is a leak
        self.runner.close()
        self.sampler.release_graphs()
        self.sampler.grammar_masks.release()  # structured outputs' bitmask buffer and compiled grammars
        self.intake.grammars.clear()
        self.kv_cache.release()
        if self.kv_cache.kv.device.type == "cuda":  # the allocator keeps freed blocks for this process otherwise
            torch.cuda.empty_cache()

    # ---- the loop (`StepLoop`) --------------------------------------------------------------------------------
    def step(self) -> list[GenerationOutput]:
        """Run one step: schedule -> forward -> sample -> update. Never raises: a failing forward ends the step's
        requests with an error output and the engine goes on.

        With overlapped scheduling the update of a step comes one call later: this call records what the queued
        step computes, schedules and queues the next one, then fetches the queued step's tokens (by then the device
        is busy with the next step) and returns its outputs. Between calls no placeholder is ever visible.

        Returns:
            Outputs of this step: deltas of streaming samples that got a token, final outputs of finished samples.
        """
        return self.loop.step()

    def flush(self) -> list[GenerationOutput]:
        """Finish the step in flight, if any, and return every output not handed out yet (the manager calls it
        before it ends requests, so that no output is lost or overtaken)."""
        return self.loop.flush()

    @property
    def overlap_scheduling(self) -> bool:
        """Whether step N+1 is scheduled before step N's tokens reach the host (the config's, or the device's)."""
        return self.loop.overlap_scheduling
