"""`SamplingParams`: how one request is sampled, validated field by field; also what the wire protocol's
`sampling` map carries (`changed_fields`, `from_fields`). Free of torch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from rollout.constraints import CONSTRAINT_FIELDS, normalized_constraint
from rollout.sampling_spellings import unknown_field_reason
from rollout.sampling_warping import warping_fields
from rollout.validation import (
    FieldError,
    _check,
    _is_int,
    _is_number,
    _listed,
    _token_ids,
    logit_bias_pairs,
    lone_surrogate,
)

# Which distribution a returned log-prob is taken under (SamplingParams.logprob_mode; the Sampler documents each).
LOGPROB_MODES = ("processed", "raw", "temperature_scaled")
# Bounds on the per-request bans, so that one request cannot make every engine step slow for everyone.
MAX_NO_REPEAT_NGRAM_SIZE = 64
MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS = 1024, 32
MAX_SUPPRESSED_TOKENS = 8192
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 32, 256
MAX_STOP_TOKEN_IDS = 1024
# Most top-k log-probs per prompt position (vLLM's default max_logprobs), and per token from a worker's sockets
# (ZeroMQ and HTTP; in process, top_logprobs goes up to 100).
MAX_PROMPT_LOGPROBS = MAX_SERVED_LOGPROBS = 20
# logit_bias: at most this many tokens (OpenAI's limit), each biased by a number in [-MAX, MAX] (OpenAI's bound).
# Smallest sampling temperature: logits divided by less overflow fp32 (0 means greedy).
MIN_TEMPERATURE = 1e-5
# Smallest repetition_penalty, for the same reason: seen tokens' positive logits are divided by it in fp32, and a
# penalty that rounds to 0 there (below ~1e-45) or divides them past fp32's range makes their scores inf and NaN
# (every sample then draws the last token id, its log-probs -inf and NaN).
MIN_REPETITION_PENALTY = 1e-5
# Used when neither the request, its SamplingParams nor the GenerationConfig says how many tokens to generate.
DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class SamplingParams:
    """How one request is sampled. Applied per request, so one batch mixes any settings.

    The processors run in the order documented on `rollout.engine.sampling.sampler.Sampler`. `None` means "take it from
    the GenerationConfig given to the manager, else the default noted on the field".
    """

    # Softmax temperature; 0 means greedy.
    temperature: float = 1.0
    # Keep only the k most likely tokens; 0 disables.
    top_k: int = 0
    # Keep the smallest set of tokens whose probability reaches top_p; 1.0 disables.
    top_p: float = 1.0
    # Drop tokens whose probability is below min_p times the top token's; 0 disables.
    min_p: float = 0.0
    # Divide positive (multiply negative) logits of tokens seen in prompt or output; 1.0 disables (HF semantics).
    repetition_penalty: float = 1.0
    # Subtract this from the logit of every token already generated (OpenAI semantics); 0 disables.
    presence_penalty: float = 0.0
    # Subtract this times the token's count among generated tokens (OpenAI semantics); 0 disables.
    frequency_penalty: float = 0.0
    # Stop tokens are masked until this many tokens were generated.
    min_new_tokens: int = 0
    # Generation ends after this many tokens (None: GenerationConfig's, else DEFAULT_MAX_NEW_TOKENS, 256, or what the
    # model's context leaves after the prompt, if less); 0 (only with prompt_logprobs) scores the prompt only.
    max_new_tokens: int | None = None
    # Any of these ends generation (None: the GenerationConfig's eos_token_id; () never stops early).
    stop_token_ids: tuple[int, ...] | None = None
    # Strings that end generation where the output text first contains one (needs a tokenizer on the engine;
    # rollout.detokenizer says which tokens and text a stopped output returns).
    stop: tuple[str, ...] = ()
    # Keep the stop string at the end of the returned text (the tokens are the same either way).
    include_stop_str_in_output: bool = False
    # Leave special tokens out of the text that stop strings are matched in (and that the HTTP API returns).
    skip_special_tokens: bool = True
    # False forces greedy decoding whatever the temperature.
    do_sample: bool = True
    # Seed of this request's randomness (None: a fresh random seed). Sample i of a group uses (seed, i).
    seed: int | None = None
    # Ban any token that would repeat an n-gram of this size already in the prompt or output; 0 disables.
    no_repeat_ngram_size: int = 0
    # Token sequences that must never be generated: the last token of each is banned where the rest precedes it.
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # Tokens never generated.
    suppress_tokens: tuple[int, ...] = ()
    # Tokens not generated as the first new token.
    begin_suppress_tokens: tuple[int, ...] = ()
    # Added to the logits of these tokens before any other processing (OpenAI / vLLM semantics). Given as a map
    # {token id: bias} (keys may be ints or strings of decimal digits, as JSON has them) or (token id, bias) pairs;
    # kept as (token id, bias) pairs sorted by token id. At most MAX_LOGIT_BIAS_TOKENS (300) tokens, biases finite
    # numbers in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], [-100, 100]; None means none.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Typical sampling: keep the locally typical tokens whose probability reaches typical_p; 1.0 disables.
    typical_p: float = 1.0
    # Drop tokens whose probability is below epsilon_cutoff (the top token always stays); 0 disables.
    epsilon_cutoff: float = 0.0
    # Eta sampling: an entropy-dependent epsilon, min(eta, sqrt(eta) * exp(-entropy)); 0 disables.
    eta_cutoff: float = 0.0
    # "processed": log-prob under the distribution actually sampled from; "raw": log_softmax of the model's logits;
    # "temperature_scaled": log_softmax(logits / temperature), what TRL and verl recompute in their losses.
    logprob_mode: Literal["processed", "raw", "temperature_scaled"] = "processed"
    # Also return the top-k log-probs (in the same mode) at every position; 0 disables. At most 100 in process, and
    # MAX_SERVED_LOGPROBS (20) through a worker's ZeroMQ and HTTP APIs and a ColocatedEngine.
    top_logprobs: int = 0
    # Also return log p(prompt[i] | prompt[:i]) for every prompt position i >= 1 (raw log_softmax of the model's
    # logits, as vLLM's prompt_logprobs), with this many top-k (token, log-prob) pairs per position, at most
    # MAX_PROMPT_LOGPROBS (20); None disables.
    prompt_logprobs: int | None = None
    # Also return the experts an MoE model's routers chose for every token computed (routing replay): the completion's
    # `routes` and `prompt_routes`. Only for MoE models.
    return_routes: bool = False
    # Structured outputs (at most one; vLLM's StructuredOutputsParams names; need the model's tokenizer on the engine,
    # `rollout.constraints`): the completion matches this regular expression, JSON schema (a dict or its JSON
    # text), one of these strings, EBNF grammar, or any JSON object. A sample the grammar completes ends with "stop".
    regex: str | None = None
    json: Any = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        constraint = normalized_constraint({name: getattr(self, name) for name in CONSTRAINT_FIELDS})
        self.json, self.choice = constraint["json"], constraint["choice"]
        _check(
            _is_number(self.temperature)
            and math.isfinite(self.temperature)
            and (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE),
            "temperature",
            f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}",
            self.temperature,
        )
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an integer >= 0 (0 disables)", self.top_k)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(
            _is_number(self.repetition_penalty) and MIN_REPETITION_PENALTY <= self.repetition_penalty < math.inf,
            "repetition_penalty",
            f"must be a finite number >= {MIN_REPETITION_PENALTY} (1.0 disables)",
            self.repetition_penalty,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, "must be a number in [-2, 2]", value)
        _check(
            _is_int(self.min_new_tokens) and self.min_new_tokens >= 0,
            "min_new_tokens",
            "must be an integer >= 0",
            self.min_new_tokens,
        )
        if self.max_new_tokens is not None:
            _check(
                _is_int(self.max_new_tokens) and self.max_new_tokens >= (0 if self.prompt_logprobs is not None else 1),
                "max_new_tokens",
                "must be an integer >= 1 (0 only with prompt_logprobs)",
                self.max_new_tokens,
            )
            _check(  # the stop tokens would stay banned to the end: min_new_tokens could never be honoured
                self.min_new_tokens <= self.max_new_tokens,
                "min_new_tokens",
                f"must be at most max_new_tokens ({self.max_new_tokens})",
                self.min_new_tokens,
            )
        if self.stop_token_ids is not None:
            if _is_int(self.stop_token_ids):
                self.stop_token_ids = (self.stop_token_ids,)
            _check(
                isinstance(self.stop_token_ids, (list, tuple))
                and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS  # checked before its items
                and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                f"must be a list of at most {MAX_STOP_TOKEN_IDS} non-negative token ids",
                self.stop_token_ids,
            )
            self.stop_token_ids = tuple(self.stop_token_ids)
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        _check(
            isinstance(self.stop, (list, tuple))
            and len(self.stop) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            "stop",
            f"must be a list of at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_STRING_CHARS} "
            "characters",
            self.stop,
        )
        self.stop = tuple(dict.fromkeys(self.stop))
        broken = next((s for s in self.stop if lone_surrogate(s) is not None), None)
        _check(  # no decoded text holds one: such a stop string could never end a completion
            broken is None, "stop", "holds a lone surrogate (a JSON \\ud800 escape), which no text holds", broken
        )
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, "must be a bool", getattr(self, name))
        _check(
            _is_int(self.no_repeat_ngram_size) and 0 <= self.no_repeat_ngram_size <= MAX_NO_REPEAT_NGRAM_SIZE,
            "no_repeat_ngram_size",
            f"must be an integer in [0, {MAX_NO_REPEAT_NGRAM_SIZE}] (0 disables)",
            self.no_repeat_ngram_size,
        )
        words = _listed("bad_words_ids", self.bad_words_ids)
        _check(len(words) <= MAX_BAD_WORDS, "bad_words_ids", f"at most {MAX_BAD_WORDS} words", words)
        self.bad_words_ids = tuple(dict.fromkeys(_token_ids("bad_words_ids", word, words) for word in words))
        _check(
            all(0 < len(word) <= MAX_BAD_WORD_TOKENS for word in self.bad_words_ids),
            "bad_words_ids",
            f"each word must have 1 to {MAX_BAD_WORD_TOKENS} tokens",
            self.bad_words_ids,
        )
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            tokens = _listed(name, getattr(self, name))
            _check(len(tokens) <= MAX_SUPPRESSED_TOKENS, name, f"at most {MAX_SUPPRESSED_TOKENS} tokens", tokens)
            setattr(self, name, tuple(dict.fromkeys(_token_ids(name, tokens))))
        self.logit_bias = logit_bias_pairs(self.logit_bias)
        _check(_is_number(self.typical_p) and 0 < self.typical_p <= 1, "typical_p", "must be in (0, 1]", self.typical_p)
        for name in ("epsilon_cutoff", "eta_cutoff"):
            value = getattr(self, name)
            _check(_is_number(value) and 0 <= value < 1, name, "must be in [0, 1) (0 disables)", value)
        _check(isinstance(self.do_sample, bool), "do_sample", "must be a bool", self.do_sample)
        if self.seed is not None:
            _check(_is_int(self.seed), "seed", "must be an integer", self.seed)
        _check(
            type(self.logprob_mode) is str and self.logprob_mode in LOGPROB_MODES,
            "logprob_mode",
            f"must be one of {LOGPROB_MODES}",
            self.logprob_mode,
        )
        _check(
            _is_int(self.top_logprobs) and 0 <= self.top_logprobs <= 100,
            "top_logprobs",
            "must be an integer in [0, 100]",
            self.top_logprobs,
        )
        _check(isinstance(self.return_routes, bool), "return_routes", "must be true or false", self.return_routes)
        if self.prompt_logprobs is not None:
            _check(
                _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS,
                "prompt_logprobs",
                f"must be None (off) or an integer in [0, {MAX_PROMPT_LOGPROBS}] (top-k per prompt position)",
                self.prompt_logprobs,
            )
        # Checked: every value is now immutable (numbers, strings, tuples), so only a field set again can unsettle it.
        object.__setattr__(self, "_checked", True)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, "_checked", False)  # set after the check: `with_defaults` checks it again
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        # An unpickled or copied object is checked again on its first use: the mark never travels in bytes.
        state = dict(self.__dict__)
        state.pop("_checked", None)
        return state

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0 or do_sample=False)."""
        return not self.do_sample or self.temperature == 0

    def with_defaults(self, defaults: SamplingParams) -> SamplingParams:
        """A private copy (the caller's later changes cannot reach it), with `stop_token_ids` and `max_new_tokens`
        taken from `defaults` where this leaves them None. Checked again only when a field of either was set since
        its check: a checked SamplingParams holds only immutable values, so its copy needs no new check (checking a
        maximal one, 1,024 bad words of 32 tokens and 8,192 suppressed tokens, takes 7 to 15 ms on a 2-core CPU).

        Args:
            defaults: the settings the generation config gives.
        """
        # One snapshot of each (a C-level copy under the interpreter lock): the mark and the values read together, so
        # a field set by another thread meanwhile cannot slip into a copy marked checked.
        state, given = dict(self.__dict__), dict(defaults.__dict__)
        fill: dict[str, Any] = {}
        if state["stop_token_ids"] is None:
            fill["stop_token_ids"] = given["stop_token_ids"]
        if state["max_new_tokens"] is None:
            fill["max_new_tokens"] = given["max_new_tokens"]
        most = fill.get("max_new_tokens")
        if most is not None and state["min_new_tokens"] > most:  # the checked copy below would skip this pair
            raise FieldError(
                "min_new_tokens",
                f"must be at most max_new_tokens ({most}, the generation config's), got {state['min_new_tokens']}",
            )
        checked = state.get("_checked") and given.get("_checked")
        state.pop("_checked", None)
        if not checked or fill.get("max_new_tokens") == 0:  # 0 is valid only beside prompt_logprobs: check it
            return type(self)(**{**{name: state[name] for name in SAMPLING_FIELDS}, **fill})
        private = object.__new__(type(self))  # no __init__, no __setattr__, no check
        private.__dict__.update(state, **fill, _checked=True)
        return private

    def merged(self, **overrides: Any) -> SamplingParams:
        """Return a copy with `overrides` applied (validated again)."""
        return dataclasses.replace(self, **overrides)

    def changed_fields(self) -> dict[str, Any]:
        """The fields that differ from the defaults, as plain values (lists for tuples): what the wire protocol's
        `sampling` map carries for these settings."""
        defaults = SamplingParams()
        return {
            item.name: _as_plain(getattr(self, item.name))
            for item in dataclasses.fields(self)
            if getattr(self, item.name) != getattr(defaults, item.name)
        }

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> SamplingParams:
        """Build from a `sampling` map of field names (the wire's), checking every field.

        Raises:
            FieldError: an unknown or bad field, named "sampling.<field>".
        """
        unknown = sorted(set(fields) - {item.name for item in dataclasses.fields(cls)}, key=repr)  # (any keys)
        if unknown:
            raise FieldError(f"sampling.{unknown[0]}", unknown_field_reason(unknown[0], SAMPLING_FIELDS))
        try:
            sampling = cls(**fields)
        except FieldError as error:
            raise FieldError(f"sampling.{error.field}", error.reason) from None
        greedy = "do_sample is False" if fields.get("do_sample") is False else ""
        greedy = greedy or ("temperature is 0" if fields.get("temperature") == 0 else "")
        warping = warping_fields(fields) if greedy else []
        if warping:  # one map that asks for greedy picks and a shaped distribution: the second would do nothing
            raise FieldError(f"sampling.{warping[0]}", f"has no effect while {greedy} (in the same map)")
        if fields.get("include_stop_str_in_output"):  # completions carry token ids, which a stop string ends alike
            raise FieldError(
                "sampling.include_stop_str_in_output",
                "has no effect here: completions carry token ids, not text (the HTTP API returns text)",
            )
        seed = fields.get("seed")
        if _is_int(seed) and not -(2**63) <= seed < 2**64:  # what msgpack carries (in-process, any integer seeds)
            raise FieldError("sampling.seed", f"must be an integer in [-2**63, 2**64) on the wire, got {seed}")
        return sampling


def _as_plain(value: Any) -> Any:
    return [_as_plain(item) for item in value] if isinstance(value, tuple | list) else value


# Every SamplingParams field name (what a `sampling` map or keyword may name).
SAMPLING_FIELDS = frozenset(field.name for field in dataclasses.fields(SamplingParams))


def served_logprobs_refusal(top_logprobs: Any) -> str | None:
    """Why a worker's sockets refuse a request's `top_logprobs` (None: they do not; a value that is not an integer
    is the engine's to name): more than `MAX_SERVED_LOGPROBS`, as vLLM's max_logprobs.

    Args:
        top_logprobs: the request's `top_logprobs`, as sent.
    """
    if isinstance(top_logprobs, int) and not isinstance(top_logprobs, bool) and top_logprobs > MAX_SERVED_LOGPROBS:
        return f"must be at most {MAX_SERVED_LOGPROBS} from a worker (vLLM's max_logprobs), got {top_logprobs}"
    return None
