"""The engine loop: `step()` reads as schedule -> run -> sample -> update. Single-threaded; the manager drives it.

With `overlap_scheduling` (the CUDA default) the update is split around the next step: a step's forward and sampling
are queued on the device, the scheduler `advance`s (computed tokens, one placeholder per sampled token), the next
step is scheduled and queued (its decode inputs read the placeholders' tokens on the device), and only then are the
first step's tokens copied to the host and `resolve`d (stop tokens, log-probs, outputs). A sample that stopped has
one wasted row in the step already queued. Anything that changes requests or weights from outside the loop
(`cancel`, `update_weights`, `close`) first drains the step in flight, so it always sees resolved tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.config import (
    DEFAULT_MAX_NEW_TOKENS,
    MAX_POLICY_VERSION,
    WEIGHT_UPDATE_MODES,
    FieldError,
    SamplingParams,
    _is_int,
    dtype_name,
)
from rollout.engine.block_manager import BlockManager
from rollout.engine.kv_cache import KVCacheShape, PagedKVCache, resolve_num_blocks
from rollout.engine.model_runner import ModelRunner, UnresolvedTokens
from rollout.engine.outputs import GenerationOutput, OutputStatus
from rollout.engine.request import Request, sample_id
from rollout.engine.sampler import PendingSamples, Sampler
from rollout.engine.scheduler import ScheduledBatch, Scheduler
from rollout.generation_config import resolve as resolve_generation_config
from rollout.transformers_configs import engine_config

logger = logging.getLogger(__name__)

# Layer types (config.layer_types) whose attention the paged cache serves; recurrent or chunked layers would need
# state the engine does not keep, so such models are refused instead of generating wrong tokens.
SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
NOTHING_TO_DRAW = (
    "every token is banned at this position (bad_words_ids, suppress_tokens, begin_suppress_tokens, "
    "no_repeat_ngram_size and min_new_tokens together leave none)"
)
# Most samples in one group: bounds what one request can make the engine allocate up front.
MAX_GROUP_SIZE = 4096


@dataclass
class WeightUpdateResult:
    """What `Engine.update_weights` did.

    Attributes:
        version: the policy version now served.
        mode: the commit mode used.
        pause_ms: how long the engine stood still (validation, copy and mode handling).
        copy_ms: of which copying the tensors into the model.
        drain_ms: for mode "wait", how long in-flight samples ran before the update (admission was paused).
        aborted: samples ended with finish_reason "abort" (mode "abort").
        recomputed: samples whose KV is recomputed under the new weights.
        outputs: the outputs of the step that was in flight, then the final outputs of the aborted samples (the
            caller delivers them).
    """

    version: int
    mode: str
    pause_ms: float
    copy_ms: float
    drain_ms: float = 0.0
    aborted: int = 0
    recomputed: int = 0
    outputs: list[GenerationOutput] = field(default_factory=list, repr=False)


@dataclass
class _InFlightStep:
    """A step queued on the device whose sampled tokens the host has not seen yet."""

    batch: ScheduledBatch
    samples: PendingSamples
    policy_version: int  # the weights that ran it (a weight update drains the step first)
    advanced: bool = False  # the scheduler counted its tokens (placeholders appended)


def _is_token(value: object, vocab_size: int) -> bool:
    return type(value) is int and 0 <= value < vocab_size


def as_prompt(input_ids: Any) -> list[int]:
    """One prompt as a fresh list of ints: from a list/tuple, or a 1-D or (1, L) tensor or numpy array.

    Raises:
        ValueError: anything else, naming input_ids.
    """
    if isinstance(input_ids, torch.Tensor) or type(input_ids).__module__ == "numpy":
        array = torch.as_tensor(input_ids)
        if array.dim() == 2 and array.shape[0] == 1:
            array = array[0]
        if array.dim() != 1 or array.is_floating_point():
            raise FieldError(
                "input_ids",
                f"expected one prompt of integer ids (1-D or (1, L)), got {array.dtype} of shape {tuple(array.shape)}",
            )
        return array.tolist()
    if not isinstance(input_ids, (list, tuple)):
        raise FieldError("input_ids", f"expected a list of token ids, got {type(input_ids).__name__}")
    # numpy / torch integer scalars become plain ints; anything else is left for validate() to name.
    return [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in input_ids]


class Engine:
    """Continuous-batching engine over one transformers model: requests in, per-step outputs out."""

    def __init__(self, model: torch.nn.Module, config: Any = None, generation_config: Any = None):
        """
        Args:
            model: a transformers causal LM (any decoder-only model whose attention uses AttentionInterface).
            config: engine settings: rollout's ContinuousBatchingConfig, transformers' (converted field by field by
                `rollout.transformers_configs`, refusing by name what rollout cannot honour), or None (defaults).
            generation_config: a `transformers.GenerationConfig` with default sampling settings; fields it leaves
                unset come from `model.generation_config`, then from transformers' global defaults, as in `generate`.
        """
        defaults = resolve_generation_config(generation_config, getattr(model, "generation_config", None))
        self.config = engine_config(config if config is not None else defaults.continuous_batching_config)
        self.default_sampling = defaults.sampling
        self.default_n = defaults.n  # num_return_sequences
        self.default_max_length = defaults.max_length  # prompt + output, when no max_new_tokens is set anywhere
        self.model = model
        model_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        unsupported = sorted(set(getattr(model_config, "layer_types", None) or ()) - SUPPORTED_LAYER_TYPES)
        if unsupported:
            supported = sorted(SUPPORTED_LAYER_TYPES)
            raise FieldError("model", f"layer types {unsupported} are not supported (only {supported})")
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
        self.sampler = Sampler(self.vocab_size)
        overlap = self.config.overlap_scheduling
        self.overlap_scheduling = parameter.device.type == "cuda" if overlap is None else overlap
        self._in_flight: _InFlightStep | None = None  # queued on the device, not resolved yet (overlap)
        self._undelivered: list[GenerationOutput] = []  # outputs of a drained step, for the next step()
        self._open_groups: dict[str, int] = {}  # group id -> samples not finished yet
        self.num_generated_tokens = 0
        self.num_computed_tokens = 0  # tokens run through the model (prefix hits and forks skip theirs)
        self.num_prefill_tokens = 0  # of which in chunks of more than one token (prompts, recomputes)
        self.num_steps = 0
        self.num_weight_updates = 0
        self.warmed_up = False  # warmup() ran
        # Seeds for requests that bring none: reproducible from config.seed, else fresh randomness.
        self._seed_source = random.SystemRandom() if self.config.seed is None else random.Random(self.config.seed)
        # Every name a weight update may target (state_dict names: parameters, tied aliases, persistent buffers).
        self._weights: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        # Names that must be covered by a whole update: one per distinct parameter (tied weights count once).
        self._parameter_names = {id(p): name for name, p in model.named_parameters()}

    @property
    def policy_version(self) -> int:
        """Version of the weights now served: 0 at start, then what each weight update set."""
        return self.block_manager.policy_version

    # ---- requests ---------------------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int) -> None:
        """Raise FieldError naming the field when a request can never be served by this model."""
        if not prompt_ids:
            raise FieldError("input_ids", "the prompt must be a non-empty list of token ids")
        for position, token in enumerate(prompt_ids):
            if not _is_token(token, self.vocab_size):
                reason = f"{token!r} at position {position} is not a token id in [0, {self.vocab_size})"
                raise FieldError("input_ids", reason)
        if len(prompt_ids) + max_new_tokens > self.max_model_len:
            raise FieldError(
                "max_new_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
                f"of {self.max_model_len} tokens",
            )
        token_fields = {
            "stop_token_ids": sampling.stop_token_ids or (),
            "suppress_tokens": sampling.suppress_tokens,
            "begin_suppress_tokens": sampling.begin_suppress_tokens,
            "bad_words_ids": [t for word in sampling.bad_words_ids for t in word],
        }
        for name, tokens in token_fields.items():
            outside = sorted({t for t in tokens if t >= self.vocab_size})
            if outside:
                raise FieldError(name, f"{outside} outside the vocabulary [0, {self.vocab_size})")
        if sampling.top_logprobs and not self.config.return_logprobs:
            raise FieldError("top_logprobs", "needs ContinuousBatchingConfig(return_logprobs=True)")
        if sampling.top_k > self.vocab_size:
            raise FieldError("top_k", f"{sampling.top_k} exceeds the vocabulary size {self.vocab_size}")

    def prepare(
        self,
        group_id: str,
        prompt_ids: Any,
        sampling: SamplingParams | None = None,
        n: int | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
    ) -> Request:
        """Validate a request and resolve its defaults without queueing it (reads no mutable engine state, so any
        thread may call it). `submit` queues the result.

        Args: as for `add_request`.
        Returns:
            The group's leader `Request` (it forks the other n - 1 samples once its prompt is computed).
        Raises:
            ValueError: bad input, naming the field.
        """
        if not isinstance(group_id, str) or not group_id or "#" in group_id:
            reason = f"must be a non-empty string without '#' (sample ids use it), got {group_id!r}"
            raise FieldError("request_id", reason)
        prompt = as_prompt(prompt_ids)
        sampling = self.resolve_sampling(sampling)
        n = self.default_n if n is None else n
        if not _is_int(n) or not 1 <= n <= MAX_GROUP_SIZE:
            raise FieldError("n", f"must be an integer in [1, {MAX_GROUP_SIZE}], got {n!r}")
        max_new = max_new_tokens if max_new_tokens is not None else sampling.max_new_tokens
        if max_new is None and self.default_max_length is not None:  # a GenerationConfig's max_length, as generate
            max_new = self.default_max_length - len(prompt)
            if max_new < 1:
                reason = f"{self.default_max_length} leaves no room after the prompt ({len(prompt)} tokens)"
                raise FieldError("max_length", reason)
        max_new = DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new
        if not _is_int(max_new) or max_new < 1:
            raise FieldError("max_new_tokens", f"must be an integer >= 1, got {max_new!r}")
        self.validate(prompt, sampling, max_new)
        return Request(
            request_id=group_id if n == 1 else sample_id(group_id, 0),
            group_id=group_id,
            sample_index=0,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            sampling=sampling,
            max_new_tokens=max_new,
            stop_token_ids=frozenset(sampling.stop_token_ids or ()),
            seed=sampling.seed if sampling.seed is not None else self._seed_source.getrandbits(63),
            arrival=0,
            num_forks=n - 1,
            streaming=streaming,
            created_time=time.perf_counter(),
            token_times=[] if record_timestamps else None,
        )

    def submit(self, request: Request) -> None:
        """Queue a request made by `prepare`.

        Raises:
            ValueError: its group id is still running.
        """
        if request.group_id in self._open_groups:
            raise FieldError("request_id", f"{request.group_id!r} is already running")
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
        Returns:
            The request ids of the n samples.
        Raises:
            ValueError: bad input (names the field).
        """
        request = self.prepare(group_id, prompt_ids, sampling, n, max_new_tokens, streaming, record_timestamps)
        self.submit(request)
        return [request.request_id] + [sample_id(group_id, i) for i in range(1, request.num_forks + 1)]

    def resolve_sampling(self, sampling: SamplingParams | None) -> SamplingParams:
        """A private copy of `sampling` (so later changes by the caller cannot reach a queued request), with stop
        tokens and max_new_tokens taken from the generation config where it leaves them None."""
        if sampling is None:
            return dataclasses.replace(self.default_sampling)
        if not isinstance(sampling, SamplingParams):
            raise FieldError("sampling", f"expected SamplingParams, got {type(sampling).__name__}")
        fill: dict[str, Any] = {}
        if sampling.stop_token_ids is None:
            fill["stop_token_ids"] = self.default_sampling.stop_token_ids
        if sampling.max_new_tokens is None:
            fill["max_new_tokens"] = self.default_sampling.max_new_tokens
        return dataclasses.replace(sampling, **fill)

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

    # ---- weights ----------------------------------------------------------------------------------------------
    def weight_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every name a weight update may target, with its dtype name and shape (state_dict names)."""
        return {name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in self._weights.items()}

    def check_weight_specs(self, specs: dict[str, tuple[str, tuple[int, ...]]], partial: bool = False) -> None:
        """Check an update's names, dtypes and shapes against the model before any byte of it is applied.

        Args:
            specs: name -> (dtype name, shape) of every tensor the update brings.
            partial: allow an update that leaves some parameters out (else every parameter must be covered).
        Raises:
            FieldError: whose `field` is the culprit tensor's name (unknown, wrong dtype or shape, or missing).
        """
        for name, (dtype, shape) in specs.items():
            target = self._weights.get(name)
            if target is None:
                raise FieldError(name, "unknown tensor: the model has no parameter or buffer of this name")
            if dtype != dtype_name(target.dtype):
                raise FieldError(name, f"dtype {dtype} does not match the model's {dtype_name(target.dtype)}")
            if tuple(shape) != tuple(target.shape):
                raise FieldError(name, f"shape {list(shape)} does not match the model's {list(target.shape)}")
        if not partial:
            covered = {id(self._weights[name]) for name in specs}
            for parameter_name in self._parameter_names.values():
                if id(self._weights[parameter_name]) not in covered:
                    raise FieldError(
                        parameter_name, "missing: a whole update must cover every parameter (or pass partial=True)"
                    )

    def _check_tied_values(self, tensors: dict[str, torch.Tensor]) -> None:
        """Two names of one tied parameter (e.g. embed_tokens and lm_head) must bring the same values."""
        first_name: dict[int, str] = {}
        for name, tensor in tensors.items():
            other = first_name.setdefault(id(self._weights[name]), name)
            if other != name and not torch.equal(tensors[other], tensor):
                raise FieldError(name, f"is tied to {other} in the model but the update gives them different values")

    def num_in_flight(self) -> int:
        """Samples that hold KV or sampled tokens, or whose step is still on the device (what a "wait" update
        waits for)."""
        return len(self.scheduler.in_flight()) or int(self._in_flight is not None)

    def update_weights(
        self,
        tensors: dict[str, torch.Tensor],
        version: int | None = None,
        mode: str = "keep",
        partial: bool = False,
    ) -> WeightUpdateResult:
        """Copy new weights into the model in place, all at once, between two steps; bump the policy version.

        Everything is validated first: a bad update changes nothing. In-place copies keep the model's tensors (and
        anything captured against them) valid.

        Args:
            tensors: name (as in the model's state_dict) -> new value.
            version: the new policy version (must exceed the current one); None adds one.
            mode: what happens to in-flight samples: "keep" (continue on their old KV), "recompute" (re-prefill
                prompt + tokens so far under the new weights), "abort" (end now with finish_reason "abort";
                samples that have not sampled yet are recomputed instead), "wait" (only valid once nothing is in
                flight: the manager pauses admission and drains first).
            partial: allow updating a subset of the parameters.
        Returns:
            A `WeightUpdateResult`; its `outputs` are the aborted samples' final outputs, for the caller to deliver.
        Raises:
            FieldError: a bad mode, version or tensor (named); nothing was changed (a "wait" refused for samples in
                flight has finished the step in flight first: its outputs come with the next `step()`).
        """
        started = time.perf_counter()
        if mode not in WEIGHT_UPDATE_MODES:
            raise FieldError("mode", f"must be one of {list(WEIGHT_UPDATE_MODES)}, got {mode!r}")
        new_version = self.policy_version + 1 if version is None else version
        if not _is_int(new_version) or not self.policy_version < new_version <= MAX_POLICY_VERSION:
            raise FieldError(
                "version",
                f"must be an integer above the current {self.policy_version} and at most {MAX_POLICY_VERSION} "
                f"(int64), got {version!r}",
            )
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise FieldError("tensors", "expected a dict of name -> torch.Tensor")
        self.check_weight_specs({n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()}, partial)
        self._check_tied_values(tensors)
        self._drain()  # the step in flight ran on the old weights: its tokens are tagged with the old version
        if mode == "wait" and self.num_in_flight():
            raise FieldError("mode", f"'wait' needs a drained engine; {self.num_in_flight()} samples are in flight")
        copy_started = time.perf_counter()
        with torch.no_grad():
            for name, tensor in tensors.items():
                self._weights[name].copy_(tensor, non_blocking=True)
            if self.kv_cache.kv.device.type == "cuda":  # non-blocking copies from pinned staging must land first
                torch.cuda.synchronize(self.kv_cache.kv.device)
        copy_ms = (time.perf_counter() - copy_started) * 1000
        self.block_manager.policy_version = new_version
        # Cached prefixes of old versions can never match again (the version is in their hash): let them go.
        self.block_manager.reset_prefix_cache()
        result = WeightUpdateResult(new_version, mode, 0.0, copy_ms)
        result.outputs, self._undelivered = self._undelivered, []
        if mode == "recompute":
            result.recomputed = self.scheduler.recompute_in_flight()
        elif mode == "abort":
            ended, result.recomputed = self.scheduler.abort_in_flight()
            aborted = self._outputs(ended)
            result.outputs += aborted
            result.aborted = sum(1 for output in aborted if output.finish_reason == "abort")
        self.num_weight_updates += 1
        result.pause_ms = (time.perf_counter() - started) * 1000
        return result

    def warmup(self, num_tokens: int = 8) -> None:
        """Capture the decode CUDA graph of every batch bucket (when graphs are on), then run one short request
        (allocator, prefill kernels), so that no later step pays for them. Leaves no trace: its cached prefix is
        forgotten and the token and step counters are restored. Call it while the engine is idle.

        Args:
            num_tokens: length of the warm-up prompt.
        """
        if self.has_unfinished():
            raise RuntimeError("warmup() needs an idle engine")
        self.runner.capture_graphs()  # largest bucket first, so the smaller ones reuse its memory
        counters = (self.num_generated_tokens, self.num_computed_tokens, self.num_prefill_tokens, self.num_steps)
        sampling = SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=2, seed=0)  # draws no seed
        num_tokens = min(num_tokens, self.max_model_len - 2)  # a short context must not refuse its own warm-up
        if num_tokens > 0:
            self.add_request("__warmup__", [0] * num_tokens, sampling)
        while self.has_unfinished():
            self.step()
        self.block_manager.reset_prefix_cache()
        # The warm-up is not served work: statistics start from where they were.
        self.num_generated_tokens, self.num_computed_tokens, self.num_prefill_tokens, self.num_steps = counters
        self.block_manager.num_prefix_tokens_hit = self.block_manager.num_prefix_tokens_queried = 0
        self.warmed_up = True

    def has_unfinished(self) -> bool:
        """True while any request is queued or running, or outputs wait to be returned by `step()`."""
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._undelivered)

    def close(self) -> None:
        """Abort what is left and give the model back its attention implementation. Outputs not returned yet are
        dropped (call `flush()` first to get them). Idempotent."""
        self._drain()
        self._undelivered = []
        for group_id in list(self._open_groups):
            self.cancel(group_id)
        self.runner.close()

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
        elif batch.swap_out:  # a step that only preempted: the preempted KV still goes to the swap space
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

    def _launch(self, batch: ScheduledBatch, previous: _InFlightStep | None) -> _InFlightStep:
        """Queue a step's forward and sampling on the device; nothing here waits for the device."""
        unresolved = None
        if previous is not None:
            rows = {request: row for row, (request, _) in enumerate(previous.batch.samples)}
            unresolved = UnresolvedTokens(previous.samples.token_ids, rows)
        logits = self.runner.run(batch, unresolved)
        samples = self.sampler.sample(logits, batch.samples, self.config.return_logprobs)
        self.num_computed_tokens += batch.num_tokens
        # Chunks of more than one token are prompts (or recomputed KV); single tokens are decodes.
        self.num_prefill_tokens += sum(seq.num_tokens for seq in batch.sequences if seq.num_tokens > 1)
        self.num_steps += 1
        return _InFlightStep(batch, samples, self.policy_version)

    def _advance(self, step: _InFlightStep) -> None:
        """Let the scheduler count what a queued step computes (once)."""
        if not step.advanced:
            self.scheduler.advance(step.batch, step.policy_version)
            step.advanced = True

    def _resolve(self, step: _InFlightStep) -> list[GenerationOutput]:
        """Bring an advanced step's tokens to the host, put them in place and return its outputs."""
        try:
            sampled = step.samples.fetch()
        except Exception as error:  # noqa: BLE001 - a device failure surfaces here when the copy is waited for
            logger.exception("engine step failed; ending its requests with an error")
            for request, _ in step.batch.samples:
                request.drop_placeholder()
            return self._end_with_error({request.group_id for request, _ in step.batch.samples}, error)
        failed: list[Request] = []
        for index in sampled.dead_rows:  # nothing was drawable: end the sample, keep no meaningless token
            request = step.batch.samples[index][0]
            if not request.is_finished:
                request.drop_placeholder()
                failed += self.scheduler.fail(request, NOTHING_TO_DRAW)
        live = [index for index, (request, _) in enumerate(step.batch.samples) if not request.is_finished]
        for index in live:
            request = step.batch.samples[index][0]
            if sampled.logprobs is not None:
                request.logprobs.append(sampled.logprobs[index])
            if sampled.top_logprobs is not None and request.sampling.top_logprobs:
                request.top_logprobs.append(sampled.top_logprobs[index])
        finished = self.scheduler.resolve(step.batch, sampled.token_ids)
        self.num_generated_tokens += len(live)
        streaming = [step.batch.samples[i][0] for i in live]
        return self._outputs(failed + finished + [r for r in streaming if r.streaming and not r.is_finished])

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
        """Outputs for requests that progressed: a streaming request gets the tokens since its last delta, a
        non-streaming one its whole output once finished. A group is forgotten when its last sample finishes."""
        outputs = []
        for request in requests:
            start = request.num_delivered_tokens if request.streaming else 0
            if request.is_finished and request.finished_time < 0:
                request.finished_time = time.perf_counter()
            outputs.append(
                GenerationOutput(
                    request_id=request.request_id,
                    prompt_ids=request.prompt_ids,
                    generated_tokens=request.token_ids[request.num_prompt_tokens + start :],
                    logprobs=request.logprobs[start:],
                    error=request.error,
                    status=_output_status(request),
                    created_time=request.created_time,
                    lifespan=(request.started_time, request.finished_time),
                    timestamps=None if request.token_times is None else request.token_times[start:],
                    group_id=request.group_id,
                    sample_index=request.sample_index,
                    top_logprobs=request.top_logprobs[start:],
                    finish_reason=request.finish_reason if request.is_finished else None,
                    is_finished=request.is_finished,
                    policy_versions=_versions_from(request.token_versions, start, request.num_output_tokens),
                    kv_version_min=request.kv_version_min,
                )
            )
            request.num_delivered_tokens = request.num_output_tokens
            if request.is_finished:
                request.sampler_state = None
                self._open_groups[request.group_id] -= 1
                if self._open_groups[request.group_id] == 0:
                    del self._open_groups[request.group_id]
        return outputs


def _output_status(request: Request) -> OutputStatus:
    if request.is_finished:
        return OutputStatus.FAILED if request.finish_reason == "error" else OutputStatus.FINISHED
    return OutputStatus.DECODING if request.num_output_tokens else OutputStatus.PREFILLING


def _versions_from(token_versions: list[list[int]], start: int, end: int) -> list[list[int]]:
    """The run-length encoded versions of output tokens [start:end) (end: all tokens so far), re-indexed."""
    if start >= end:
        return []
    runs = [[version, max(0, first - start)] for version, first in token_versions]
    # Keep only the last run that begins at or before `start`, and every later one.
    first_kept = max((i for i, (_, first) in enumerate(token_versions) if first <= start), default=0)
    return runs[first_kept:]
