"""The engine loop: `step()` reads as schedule -> run -> sample -> update. Single-threaded; the manager drives it.

With `overlap_scheduling` (the CUDA default) the update is split around the next step: a step's forward and sampling
are queued on the device, the scheduler `advance`s (computed tokens, one placeholder per sampled token), the next
step is scheduled and queued (its decode inputs read the placeholders' tokens on the device), and only then are the
first step's tokens copied to the host and `resolve`d (stop tokens, log-probs, outputs). A sample that stopped has
one wasted row in the step already queued. Anything that changes requests or weights from outside the loop
(`cancel`, `update_weights`, `close`) first drains the step in flight, so it always sees resolved tokens.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rollout.config import FieldError, SamplingParams
from rollout.engine.counters import engine_stats, log_leaks
from rollout.engine.kv.kv_cache import KVCacheShape, PagedKVCache, resolve_num_blocks
from rollout.engine.requests.group_spec import GroupSpec
from rollout.engine.requests.intake import RequestIntake
from rollout.engine.requests.outputs import GenerationOutput, progress_output
from rollout.engine.requests.request import Request, RequestStatus, sample_id
from rollout.engine.runner.model_checks import servable_text_config
from rollout.engine.runner.model_runner import ModelRunner, UnresolvedTokens
from rollout.engine.sampling.broken_samples import end_broken
from rollout.engine.sampling.pending_samples import InFlightStep
from rollout.engine.sampling.prompt_logprobs import deliver as deliver_prompt_logprobs
from rollout.engine.sampling.sampler import Sampler
from rollout.engine.scheduling.batch import ScheduledBatch
from rollout.engine.scheduling.block_manager import BlockManager
from rollout.engine.scheduling.scheduler import Scheduler
from rollout.engine.warmup import warm_up
from rollout.engine.weights.engine_weights import EngineWeights
from rollout.engine.weights.weight_table import WeightTable
from rollout.generation_config import resolve as resolve_generation_config
from rollout.transformers_configs import engine_config

logger = logging.getLogger(__name__)

NOTHING_TO_DRAW = (
    "no token can be drawn at this position: every token is banned (bad_words_ids, suppress_tokens, "
    "begin_suppress_tokens, no_repeat_ngram_size and min_new_tokens together leave none)"
)


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
            FieldError: a model the engine cannot serve or a setting it cannot honour (named), or a KV cache that
                does not fit the device's free memory ("num_blocks").
        """
        defaults = resolve_generation_config(generation_config, getattr(model, "generation_config", None))
        self.config = engine_config(config if config is not None else defaults.continuous_batching_config)
        self.model = model
        model_config = servable_text_config(model)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = self.config.max_model_len or getattr(model_config, "max_position_embeddings", 1 << 20)
        parameter = next(model.parameters())
        shape = KVCacheShape.from_model_config(model.config)
        num_blocks = resolve_num_blocks(self.config, shape, parameter.dtype, parameter.device, self.max_model_len)
        self.kv_cache = PagedKVCache(
            shape, num_blocks, self.config.block_size, parameter.dtype, parameter.device, self.config.cpu_offload_space
        )
        self.block_manager = BlockManager(
            num_blocks, self.config.block_size, self.config.allow_block_sharing, self.kv_cache.num_swap_blocks
        )
        self.scheduler = Scheduler(
            self.block_manager, self.config.max_batch_tokens, self.config.max_num_seqs, self.config.scheduler_type
        )
        self.runner = ModelRunner(model, self.kv_cache, self.config, self.max_model_len)
        self.block_manager.zero_new_blocks = self.runner.heads_per_kv is None  # PyTorch attention reads whole blocks
        self.block_manager.routed = self.runner.routes.cache  # cached blocks whose MoE routes are known
        self.sampler = Sampler(self.vocab_size, parameter.device)
        overlap = self.config.overlap_scheduling
        self.overlap_scheduling = parameter.device.type == "cuda" if overlap is None else overlap
        self._in_flight: InFlightStep | None = None  # queued on the device, not resolved yet (overlap)
        self._undelivered: list[GenerationOutput] = []  # outputs of a drained step, for the next step()
        self._open_groups: dict[str, int] = {}  # group id -> samples not finished yet
        self.num_generated_tokens = 0
        self.num_computed_tokens = 0  # tokens run through the model (prefix hits and forks skip theirs)
        self.num_prefill_tokens = 0  # of which in chunks of more than one token (prompts, recomputes)
        self.num_steps = 0
        self.num_weight_updates = 0
        self.warmed_up = False  # warmup() ran
        self.intake = RequestIntake(
            self.vocab_size,
            self.max_model_len,
            self.config,
            defaults,
            tokenizer,
            self.runner.adapters.ref,
            routes_refusal=self.runner.routes_refusal(),
        )
        self.weights = WeightTable(model)

    # ---- requests ---------------------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request made by `intake.prepare` (`RequestIntake`).

        Raises:
            ValueError: its group id is still running, or it asks for prompt_logprobs this model cannot give.
        """
        if self.kv_cache.is_released and self.runner.closed:
            raise RuntimeError("this engine is closed: its KV cache and graphs were freed; build a new one")
        if request.group_id in self._open_groups:
            raise FieldError("group_id", f"{request.group_id!r} is already running")
        self.runner.prompt_scorer.admit(request)  # prompt_logprobs on a model known not to give them: refused
        self.runner.routes.admit(request)  # return_routes on a dense model: refused
        self.scheduler.add(request)
        self._open_groups[request.group_id] = request.num_forks + 1

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
            sampling: sampling parameters (copied; None fields come from the generation config).
            n: samples in the group (None: the GenerationConfig's num_return_sequences, else 1); sample i is seeded
                from (seed, i).
            max_new_tokens: overrides `sampling.max_new_tokens`.
            streaming: emit a delta after every token (else one output per sample when it finishes).
            record_timestamps: outputs carry the time each token reached the host (`GenerationOutput.timestamps`).
            adapter: the LoRA adapter to sample with (`load_adapter`); None: the base model.
        Returns:
            The request ids of the n samples.
        Raises:
            ValueError: bad input (names the field).
        """
        spec = GroupSpec(group_id, prompt_ids, sampling, n, max_new_tokens, streaming, record_timestamps, adapter)
        request = self.intake.prepare(spec)
        self.submit(request)
        return [request.request_id] + [sample_id(group_id, i) for i in range(1, request.num_forks + 1)]

    def cancel(self, group_id: str) -> list[GenerationOutput]:
        """Abort every unfinished sample of a group.

        Returns:
            The group's outputs of the step in flight (finished first), then the final outputs of its aborted
            samples (finish_reason "abort"). Other groups' outputs of that step come with the next `step()`.
        """
        self._drain()
        drained = [output for output in self._undelivered if output.group_id == group_id]
        self._undelivered = [output for output in self._undelivered if output.group_id != group_id]
        if group_id not in self._open_groups:
            return drained
        return drained + self._outputs(self.scheduler.abort(group_id))

    @property
    def num_blocks(self) -> int:
        """KV cache blocks (of `config.block_size` tokens each) on the device."""
        return self.block_manager.num_blocks

    def open_group_ids(self) -> list[str]:
        """Groups queued or running (not every sample finished yet)."""
        return list(self._open_groups)

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
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._undelivered)

    def close(self) -> None:
        """Abort what is left, give the model back its attention implementation, and free the KV cache, the swap
        space and the decode graphs at once (on CUDA their cached blocks go back to the device), whoever still
        holds this engine (and the grammars' buffers and compile caches). Outputs not returned yet are dropped
        (call `flush()` first to get them). Idempotent."""
        self._drain()
        self._undelivered = []
        for group_id in list(self._open_groups):
            self.cancel(group_id)
        log_leaks(self)  # every request ended: a block, slot or row still held is a leak
        self.runner.close()
        self.sampler.grammar_masks.release()  # structured outputs' bitmask buffer and compiled grammars
        self.intake.grammars.clear()
        self.kv_cache.release()
        if self.kv_cache.kv.device.type == "cuda":  # the allocator keeps freed blocks for this process otherwise
            torch.cuda.empty_cache()

    # ---- the loop ---------------------------------------------------------------------------------------------
    def step(self) -> list[GenerationOutput]:
        """Run one step: schedule -> forward -> sample -> update. Never raises: a failing forward ends the step's
        requests with an error output and the engine goes on.

        With overlapped scheduling the update of a step comes one call later: this call records what the queued
        step computes, schedules and queues the next one, then fetches the queued step's tokens (by then the device
        is busy with the next step) and returns its outputs. Between calls no placeholder is ever visible.

        Returns:
            Outputs of this step: deltas of streaming samples that got a token, final outputs of finished samples.
        """
        outputs, self._undelivered = self._undelivered, []
        previous = self._in_flight  # stays reachable (for _drain) until it is resolved, whatever raises meanwhile
        if previous is not None:
            self._advance(previous)
        batch = self.scheduler.schedule()
        outputs += self._outputs(batch.finished)
        launched, failure = None, None
        if not batch.is_empty:
            try:
                launched = self._launch(batch, previous)
            except Exception as error:  # noqa: BLE001 - the loop must survive any model failure
                logger.exception("engine step failed; ending its requests with an error")
                failure = error
        elif batch.swap_out or batch.zero_blocks:  # nothing computed: preempted KV still goes to the swap space
            self.runner.move_blocks(batch)
        if previous is not None:
            self._in_flight = None
            outputs += self._resolve(previous)
        if failure is not None:
            outputs += self._end_with_error({seq.request.group_id for seq in batch.sequences}, failure)
        if launched is not None and not self.overlap_scheduling:
            self._advance(launched)
            return outputs + self._resolve(launched)
        self._in_flight = launched
        return outputs

    def _launch(self, batch: ScheduledBatch, previous: InFlightStep | None) -> InFlightStep:
        """Queue a step's forward and sampling on the device; nothing here waits for the device."""
        unresolved = None
        if previous is not None:
            rows = {request: row for row, (request, _) in enumerate(previous.batch.samples)}
            unresolved = UnresolvedTokens(previous.samples.token_ids, rows)
        logits = self.runner.run(batch, unresolved)
        constrained = any(request.constraint is not None for request, _ in batch.samples)  # one check per step
        if constrained and previous is not None and previous.constrained:
            self._accept_ahead(previous)  # while the device runs this step's forward
        samples = self.sampler.sample(logits, batch.samples, self.config.return_logprobs)
        chunks = [seq.num_tokens for seq in batch.sequences]
        self.num_computed_tokens += sum(chunks)
        # Chunks of more than one token are prompts (or recomputed KV); single tokens are decodes.
        self.num_prefill_tokens += sum(chunks) - chunks.count(1)
        self.num_steps += 1
        return InFlightStep(
            batch,
            samples,
            self.policy_version,
            prompt_logprobs=self.runner.prompt_results,
            routes=self.runner.route_results,
            constrained=constrained,
        )

    @staticmethod
    def _accept_ahead(previous: InFlightStep) -> None:
        """Bring the step before's tokens to the host early (the forward just queued keeps the device busy) and
        advance its open grammars past them, so this step's masks can be filled; the step is resolved as usual
        afterwards (its `accept` skips what was advanced here)."""
        sampled = previous.samples.fetch()
        dead = {*sampled.dead_rows, *sampled.broken_rows}
        for index, (request, _) in enumerate(previous.batch.samples):
            if request.constraint is not None and index not in dead and not request.is_finished:
                request.constraint.accept_ahead(sampled.token_ids[index])

    def _advance(self, step: InFlightStep) -> None:
        """Let the scheduler count what a queued step computes (once)."""
        if not step.advanced:
            self.scheduler.advance(step.batch, step.policy_version)
            step.advanced = True

    def _resolve(self, step: InFlightStep) -> list[GenerationOutput]:
        """Bring an advanced step's tokens to the host, put them in place and return its outputs."""
        try:
            sampled = step.samples.fetch()
            deliver_prompt_logprobs(step.prompt_logprobs)  # before any output: a sample's first one carries them
            if step.routes is not None:
                step.routes.deliver(self.block_manager.cached_blocks)
        except Exception as error:  # noqa: BLE001 - a device failure surfaces here when the copy is waited for
            logger.exception("engine step failed; ending its requests with an error")
            for request, _ in step.batch.samples:
                request.drop_placeholder()
            return self._end_with_error({request.group_id for request, _ in step.batch.samples}, error)
        failed = end_broken(self.scheduler, self.block_manager, step.batch.samples, sampled.broken_rows)
        for index in sampled.dead_rows:  # nothing was drawable: end the sample, keep no meaningless token
            request = step.batch.samples[index][0]
            if not request.is_finished:
                request.drop_placeholder()
                reason = NOTHING_TO_DRAW
                if request.constraint is not None:
                    reason = f"{request.constraint.field}: the grammar allows no token at this position"
                failed += self.scheduler.fail(request, reason)
        if sampled.top_logprobs is not None:
            for index, (request, _) in enumerate(step.batch.samples):
                if request.status != RequestStatus.FINISHED and request.sampling.top_logprobs:
                    request.top_logprobs.append(sampled.top_logprobs[index])
        resolved = self.scheduler.resolve(step.batch, sampled.token_ids, sampled.logprobs)
        self.num_generated_tokens += len(resolved)
        done = RequestStatus.FINISHED
        finished = [r for r in resolved if r.status == done]
        streaming = [r for r in resolved if r.streaming and r.status != done]
        return self._outputs(failed + finished + streaming)

    def _end_with_error(self, group_ids: set[str], error: BaseException) -> list[GenerationOutput]:
        """End every sample of these groups with finish_reason "error"."""
        ended: list[Request] = []
        for group_id in group_ids:
            ended += self.scheduler.abort(group_id)
        for request in ended:
            request.finish_reason, request.error = "error", f"{type(error).__name__}: {error}"
        return self._outputs(ended)

    def _drain(self) -> None:
        """Finish the step in flight (its outputs wait for the next `step()` or `flush()`), so that the engine's
        state is final: done before anything changes requests or weights from outside the loop."""
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._advance(step)
            self._undelivered += self._resolve(step)

    def flush(self) -> list[GenerationOutput]:
        """Finish the step in flight, if any, and return every output not handed out yet (the manager calls it
        before it ends requests, so that no output is lost or overtaken)."""
        self._drain()
        outputs, self._undelivered = self._undelivered, []
        return outputs

    def _outputs(self, requests: list[Request]) -> list[GenerationOutput]:
        """Outputs for requests that progressed (`outputs.progress_output`); a finished sample gives back its
        sampling slot, and a group is forgotten when its last sample finishes."""
        outputs = [progress_output(request) for request in requests]
        for request in requests:
            if request.is_finished:
                self.sampler.release(request)
                self.runner.release(request)
                self._open_groups[request.group_id] -= 1
                if self._open_groups[request.group_id] == 0:
                    del self._open_groups[request.group_id]
        return outputs
