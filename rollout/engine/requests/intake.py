"""Request intake: a prompt and its settings checked against the model and resolved into a group's leader
`Request` (defaults from the generation config, a seed when none was given), without touching the engine's
mutable state, so any thread may prepare a request; the engine thread queues it (`Engine.submit`)."""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from rollout.config import DEFAULT_MAX_NEW_TOKENS, ContinuousBatchingConfig, FieldError, SamplingParams, _is_int
from rollout.constraints import constraint_of
from rollout.detokenizer import OutputText
from rollout.engine.grammar.constraints import Constrained, Grammars
from rollout.engine.requests.adapter_ref import AdapterRef
from rollout.engine.requests.bans import check_first_token
from rollout.engine.requests.group_spec import GroupSpec
from rollout.engine.requests.keyword_fields import is_token, sampling_with_fields
from rollout.engine.requests.prompt_ids import as_prompt
from rollout.engine.requests.request import Request, sample_id
from rollout.engine.requests.route_rows import RouteRows
from rollout.generation_config import GenerationDefaults
from rollout.sampling_warping import warping_fields
from rollout.validation import all_plain_ints, in_range

# Most samples in one group: bounds what one request can make the engine allocate up front.
MAX_GROUP_SIZE = 4096
# The engine and the wire protocol say prompt_ids and group_id; transformers' API, which ContinuousBatchingManager
# and generate_batch mirror, says input_ids and request_id. Errors are renamed once, at that surface.
TRANSFORMERS_FIELD_NAMES = {"prompt_ids": "input_ids", "group_id": "request_id"}


class TorchSeeds:
    """Request seeds drawn from torch's default generator: after `torch.manual_seed(s)` (or transformers'
    `set_seed`) the same calls draw the same seeds, as transformers' `generate` and `generate_batch` draw their
    tokens from it. Only for a caller's own process: a worker keeps fresh randomness (forked processes share this
    generator's state)."""

    def getrandbits(self, bits: int) -> int:
        """A seed of at most `bits` bits (at most 63), one draw from torch's default generator.

        Args:
            bits: the width of the seed.
        """
        return int(torch.randint(0, (1 << bits) - 1, ()))


class RequestIntake:
    """Checks and resolves requests for one model: its vocabulary, context length and generation defaults."""

    def __init__(
        self,
        vocab_size: int,
        max_model_len: int,
        config: ContinuousBatchingConfig,
        defaults: GenerationDefaults,
        tokenizer: Any = None,
        adapter_ref: Callable[[str], AdapterRef] | None = None,
        routes_refusal: str | None = None,
        media_tokens: dict[int, str] | None = None,
    ):
        """
        Args:
            vocab_size: token ids must be below it.
            max_model_len: prompt + max_new_tokens must fit in it.
            config: the engine's settings (seed, return_logprobs).
            defaults: the resolved generation config (sampling defaults, num_return_sequences, max_length).
            tokenizer: decodes outputs for stop strings (`SamplingParams.stop`); None: stop strings are refused.
            adapter_ref: the served LoRA adapter of a name (raising FieldError for an unknown one); None: the engine
                serves no adapter.
            routes_refusal: why `return_routes` cannot be honoured (None: it can; a dense model, say).
            media_tokens: a multimodal model's placeholder token ids -> the config field naming each: refused in
                prompts (the engine serves text only).
        """
        self.tokenizer = tokenizer
        self.grammars = Grammars()  # structured outputs' compiled grammars, per tokenizer
        self.adapter_ref = adapter_ref
        self.routes_refusal = routes_refusal
        self.media_tokens = media_tokens or {}
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.config = config
        self.default_sampling = defaults.sampling
        self.caller_sampling = defaults.caller_sampling  # said once when a request's own SamplingParams drops them
        self._said_dropped = False
        self.default_n = defaults.n  # num_return_sequences
        self.default_max_length = defaults.max_length  # prompt + output, when no max_new_tokens is set anywhere
        # Seeds for requests that bring none: reproducible from config.seed, else fresh randomness (`generate_batch`
        # sets `TorchSeeds()` for its calls, so that torch.manual_seed repeats them as it does transformers' sampling).
        self.seed_source: random.Random | TorchSeeds = (
            random.SystemRandom() if config.seed is None else random.Random(config.seed)
        )

    def _seed(self, sampling: SamplingParams) -> int:
        """The request's seed: its own, else one from `seed_source`; a greedy request under `TorchSeeds` takes 0 and
        draws nothing (transformers' greedy `generate` leaves torch's generator where it was)."""
        if sampling.seed is not None:
            return sampling.seed
        if sampling.greedy and isinstance(self.seed_source, TorchSeeds):
            return 0
        return self.seed_source.getrandbits(63)

    def validate(self, prompt_ids: list[int], sampling: SamplingParams, max_new_tokens: int) -> None:
        """Raise FieldError naming the field when a request can never be served by this model."""
        if not prompt_ids:
            raise FieldError("prompt_ids", "the prompt must be a non-empty list of token ids")
        fine = all_plain_ints(prompt_ids) and in_range(prompt_ids, 0, self.vocab_size)  # C speed
        for position, token in enumerate([] if fine else prompt_ids):
            if not is_token(token, self.vocab_size):
                reason = f"{token!r} at position {position} is not a token id in [0, {self.vocab_size})"
                raise FieldError("prompt_ids", reason)
        if self.media_tokens and not self.media_tokens.keys().isdisjoint(prompt_ids):
            position, token = next((i, t) for i, t in enumerate(prompt_ids) if t in self.media_tokens)
            raise FieldError(
                "prompt_ids",
                f"token {token} at position {position} is the model's media placeholder "
                f"({self.media_tokens[token]}): rollout serves text only, no images, video or audio",
            )
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
            "logit_bias": [t for t, _ in sampling.logit_bias],
        }
        for name, tokens in token_fields.items():
            outside = sorted({t for t in tokens if t >= self.vocab_size})
            if outside:
                raise FieldError(name, f"{outside} outside the vocabulary [0, {self.vocab_size})")
        if sampling.top_logprobs and not self.config.return_logprobs:
            raise FieldError("top_logprobs", "needs ContinuousBatchingConfig(return_logprobs=True)")
        if sampling.top_logprobs > self.vocab_size:  # (the step's top-k would fail the sample with torch's words)
            raise FieldError("top_logprobs", f"{sampling.top_logprobs} exceeds the vocabulary size {self.vocab_size}")
        if sampling.top_k > self.vocab_size:
            raise FieldError("top_k", f"{sampling.top_k} exceeds the vocabulary size {self.vocab_size}")
        if sampling.return_routes and self.routes_refusal is not None:
            raise FieldError("return_routes", self.routes_refusal)
        if (sampling.prompt_logprobs or 0) > self.vocab_size:
            raise FieldError("prompt_logprobs", f"{sampling.prompt_logprobs} exceeds the vocabulary size")
        if sampling.stop and self.tokenizer is None:
            reason = (
                "stop strings need a tokenizer: pass tokenizer= to generate_batch / init_continuous_batching, or "
                "serve a model with one (rollout-worker --tokenizer)"
            )
            from_config = bool(self.default_sampling.stop) and sampling.stop == self.default_sampling.stop
            raise FieldError("stop_strings" if from_config else "stop", reason)  # as the caller named them

    def prepare(self, spec: GroupSpec) -> Request:
        """Validate a group and resolve its defaults without queueing it (reads no mutable engine state, so any
        thread may call it). `submit` queues the result.

        Args:
            spec: the group as asked for.
        Returns:
            The group's leader `Request` (it forks the other n - 1 samples once its prompt is computed).
        Raises:
            ValueError: bad input, naming the field.
        """
        group_id, sampling, n, max_new_tokens, adapter = (
            spec.group_id,
            spec.sampling,
            spec.n,
            spec.max_new_tokens,
            spec.adapter,
        )
        if not isinstance(group_id, str) or not group_id or "#" in group_id:
            shown = repr(group_id[:64] + "...") if isinstance(group_id, str) and len(group_id) > 64 else repr(group_id)
            reason = f"must be a non-empty string without '#' (sample ids use it), got {shown}"  # a reply stays small
            raise FieldError("group_id", reason)
        for name in ("client", "session"):
            if not isinstance(getattr(spec, name), str):
                raise FieldError(name, f"must be a string, got {type(getattr(spec, name)).__name__}")
        for name in ("streaming", "record_timestamps"):
            if not isinstance(getattr(spec, name), bool):
                raise FieldError(name, f"must be True or False, got {getattr(spec, name)!r}")
        prompt = as_prompt(spec.prompt_ids)
        own = own_length(sampling)
        sampling = self.resolve_sampling(sampling)  # (its max_new_tokens may be the generation config's, below)
        n = self.default_n if n is None else n
        if not _is_int(n) or not 1 <= n <= MAX_GROUP_SIZE:
            raise FieldError("n", f"must be an integer in [1, {MAX_GROUP_SIZE}], got {n!r}")
        given = (max_new_tokens, own)
        if None not in given and given[0] != given[1]:  # both the request's own: neither may silently lose
            reason = f"{given[0]!r} given beside the sampling's max_new_tokens={given[1]!r}: give one of them"
            raise FieldError("max_new_tokens", reason)
        max_new = max_new_tokens if max_new_tokens is not None else sampling.max_new_tokens
        if max_new is None and self.default_max_length is not None:  # a GenerationConfig's max_length, as generate
            max_new = self.default_max_length - len(prompt)
            if max_new < 1:
                reason = f"{self.default_max_length} leaves no room after the prompt ({len(prompt)} tokens)"
                raise FieldError("max_length", reason)
            if self.default_max_length > self.max_model_len:  # named as given, not as the max_new_tokens it makes
                reason = f"{self.default_max_length} exceeds the model's context of {self.max_model_len} tokens"
                raise FieldError("max_length", reason)
        if max_new is None:  # asked for nowhere: rollout's default, within what the context leaves (at least 1)
            max_new = max(1, min(DEFAULT_MAX_NEW_TOKENS, self.max_model_len - len(prompt)))
        scoring = sampling.prompt_logprobs is not None
        if not _is_int(max_new) or max_new < (0 if scoring else 1):  # 0: score the prompt only (prompt_logprobs)
            raise FieldError("max_new_tokens", f"must be an integer >= 1 (0 with prompt_logprobs), got {max_new!r}")
        if sampling.min_new_tokens > max_new:  # SamplingParams checks the pair only when both are given; one past
            # int64 would fail the engine step holding it, every other client's samples in that step with it
            reason = f"{sampling.min_new_tokens} is more than the {max_new} tokens this request may generate"
            raise FieldError("min_new_tokens", f"{reason} (max_new_tokens, from the request or its defaults)")
        self.validate(prompt, sampling, max_new)
        ref = None
        if adapter is not None:
            if self.adapter_ref is None:
                raise FieldError("adapter", "this engine serves no LoRA adapter")
            ref = self.adapter_ref(adapter)
        request = Request(
            request_id=group_id if n == 1 else sample_id(group_id, 0),
            group_id=group_id,
            sample_index=0,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            sampling=sampling,
            max_new_tokens=max(max_new, 1),
            stop_token_ids=frozenset(sampling.stop_token_ids or ()),
            seed=self._seed(sampling),
            arrival=0,
            num_forks=n - 1,
            streaming=spec.streaming,
            created_time=time.perf_counter(),
            token_times=[] if spec.record_timestamps else None,
            stop_text=self._stop_text(prompt, sampling),
            prompt_logprobs=[None] if scoring else None,
            prompt_top_logprobs=[None] if scoring else None,
            prompt_logprob_ranks=[None] if scoring else None,
            score_only=max_new == 0,
            adapter=ref,
            client=spec.client,
            session=spec.session,
        )
        if not request.score_only:
            check_first_token(request, self.vocab_size)
        if sampling.return_routes:
            request.routes = RouteRows(len(prompt), request)
        request.constraint = self.constraint(sampling)
        if request.constraint is not None and sampling.min_new_tokens:
            # The grammar's end tokens end a sample as a stop token does (`Request.add_token`): masked alike until
            # min_new_tokens tokens came, so a sample is never cut short of them by its grammar completing.
            ends = request.constraint.compiled.tokenizer_info.stop_token_ids
            request.stop_token_ids = request.stop_token_ids | frozenset(ends)
            # ... and no sample may take a branch of the grammar that ends before them (grammar/length_goal.py).
            request.constraint.goal = self.grammars.length_goal(
                self.tokenizer, self.vocab_size, sampling.min_new_tokens, request.stop_token_ids
            )
        return request

    def constraint(self, sampling: SamplingParams) -> Constrained | None:
        """A fresh grammar state for `sampling`'s structured-output constraint (None: it has none), compiled with this
        model's tokenizer (compiled grammars are cached, so a spec compiles once).

        Raises:
            FieldError: naming the constraint field: no tokenizer, no xgrammar, a spec that does not compile, or one
                no sample can follow (no token at the first step; every output ends before min_new_tokens).
        """
        constraint = constraint_of(sampling)
        if constraint is None:
            return None
        field, spec = constraint
        stops = frozenset(sampling.stop_token_ids or ())
        compiled = self.grammars.compile(self.tokenizer, self.vocab_size, field, spec, sampling.min_new_tokens, stops)
        return Constrained(field, compiled)

    def _stop_text(self, prompt: list[int], sampling: SamplingParams) -> OutputText | None:
        """What finds the request's stop strings in its output (None when it has none)."""
        if not sampling.stop:
            return None
        return OutputText(
            self.tokenizer,
            prompt,
            sampling.skip_special_tokens,
            sampling.stop,
            sampling.include_stop_str_in_output,
            sampling.min_new_tokens,
        )

    def resolve_sampling(self, sampling: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """A private copy of `sampling` (so later changes by the caller cannot reach a queued request), with stop
        tokens and max_new_tokens taken from the generation config where it leaves them None; a dict of
        SamplingParams fields is applied over the generation config's settings, as keyword fields are."""
        if sampling is None:
            sampling = self.default_sampling
        if isinstance(sampling, dict):  # SamplingParams fields by name (as a RolloutClient takes them), applied over
            # the generation config's defaults as keywords are
            sampling = self.with_fields(None, None, dict(sampling)) or self.default_sampling
        if not isinstance(sampling, SamplingParams):
            raise FieldError(
                "sampling", f"expected SamplingParams or a dict of its fields, got {type(sampling).__name__}"
            )
        return sampling.with_defaults(self.default_sampling)

    def say_dropped(self, sampling: SamplingParams | None) -> None:
        """Warn, once per engine, when a caller's request brings its own SamplingParams that leaves out sampling
        settings the caller's GenerationConfig set: a SamplingParams replaces them (only stop tokens and
        max_new_tokens are merged), as documented, but the caller gave both (`generate_batch`, the manager).

        Args:
            sampling: the request's own SamplingParams (None: it takes the generation config's).
        """
        if sampling is None or self._said_dropped or not isinstance(sampling, SamplingParams):
            return
        dropped = {name: value for name, value in self.caller_sampling.items() if getattr(sampling, name) != value}
        if self.default_sampling.greedy:  # the config's own picks are greedy: its warping settings did nothing
            for name in warping_fields(dropped):
                del dropped[name]
        if dropped:
            self._said_dropped = True
            settings = ", ".join(f"{name}={value!r}" for name, value in dropped.items())
            warnings.warn(
                f"a request's own SamplingParams replaces the generation_config's sampling settings (only its stop "
                f"tokens and max_new_tokens are merged): {settings} from the generation_config are not used for it; "
                "set them in the SamplingParams (said once per engine)",
                UserWarning,
                stacklevel=3,
            )

    def with_fields(
        self, sampling: SamplingParams | None, eos_token_id: Any, fields: dict[str, Any]
    ) -> SamplingParams | None:
        """`sampling` (or the generation config's defaults) with per-request keyword fields applied (the manager's
        `add_request(..., temperature=0.7, eos_token_id=...)`); see `keyword_fields.sampling_with_fields`.

        Args:
            sampling: the request's SamplingParams, or None.
            eos_token_id: the request's stop token(s), or None; negative ids stand for none (transformers' -1).
            fields: SamplingParams fields by name.
        """
        return sampling_with_fields(self.default_sampling, self.vocab_size, sampling, eos_token_id, fields)


def own_length(sampling: Any) -> Any:
    """The `max_new_tokens` a request's own sampling settings give (a SamplingParams, a dict of its fields, or None),
    before any default fills it in.

    Args:
        sampling: the settings as the caller gave them.
    """
    return sampling.get("max_new_tokens") if isinstance(sampling, dict) else getattr(sampling, "max_new_tokens", None)
