"""Validated configuration dataclasses: the engine's `ContinuousBatchingConfig` and per-request `SamplingParams`.

Field names follow transformers' continuous batching where the concept is the same, so its users can carry their
settings over. Every field is checked in `__post_init__`; a bad value raises `FieldError` (a ValueError) naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # this module stays free of torch and transformers at import (the scheduler imports it)
    from transformers import CompileConfig

SCHEDULER_TYPES = ("fifo", "prefill_first")
# Which distribution a returned log-prob is taken under (SamplingParams.logprob_mode; the Sampler documents each).
LOGPROB_MODES = ("processed", "raw", "temperature_scaled")
# Bounds on the per-request bans, so that one request cannot make every engine step slow for everyone.
MAX_NO_REPEAT_NGRAM_SIZE = 64
MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS = 1024, 32
MAX_SUPPRESSED_TOKENS = 8192
# Smallest sampling temperature: logits divided by less overflow fp32 (0 means greedy).
MIN_TEMPERATURE = 1e-5
# Policy versions travel as int64 (msgpack, tensors of versions): the largest a weight update may set.
MAX_POLICY_VERSION = 2**63 - 1
# What happens to in-flight samples when a weight update commits (Engine.update_weights documents each).
WEIGHT_UPDATE_MODES = ("keep", "recompute", "abort", "wait")
# Used when neither the request, its SamplingParams nor the GenerationConfig says how many tokens to generate.
DEFAULT_MAX_NEW_TOKENS = 256


def dtype_name(dtype: Any) -> str:
    """A torch dtype as the wire names it: "bfloat16", "float32", ..."""
    return str(dtype).removeprefix("torch.")


class FieldError(ValueError):
    """Bad input, naming the field that is wrong (the service turns it into an error reply carrying `field`)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def renamed(self, names: dict[str, str]) -> FieldError:
        """The same error under another layer's name for its field (`names`: ours -> theirs), else itself."""
        return FieldError(names[self.field], self.reason) if self.field in names else self


_SHORT = reprlib.Repr()  # attributes, not keywords: Python 3.10/3.11 take none
_SHORT.maxlist = _SHORT.maxtuple = 8
_SHORT.maxstring = _SHORT.maxother = 80


def _check(condition: bool, name: str, reason: str, value: Any) -> None:
    """Raise a FieldError naming the field `name` when `condition` is false (the value shown abridged: a huge bad
    value must not make a huge error message)."""
    if not condition:
        raise FieldError(name, f"{_SHORT.repr(value)} is invalid: {reason}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _listed(name: str, value: Any) -> list | tuple:
    _check(isinstance(value, (list, tuple)), name, "must be a list", value)
    return value


def _token_ids(name: str, value: Any, whole: Any = None) -> tuple[int, ...]:
    """`value` as a tuple of token ids, or a FieldError naming `name` (showing `whole` when given)."""
    _check(
        isinstance(value, (list, tuple)) and all(_is_int(t) and t >= 0 for t in value),
        name,
        "must be a list of non-negative token ids" + (" per word" if whole is not None else ""),
        value if whole is None else whole,
    )
    return tuple(value)


@dataclass
class SamplingParams:
    """How one request is sampled. Applied per request, so one batch mixes any settings.

    The processors run in the order documented on `rollout.engine.sampler.Sampler`. `None` means "take it from the
    GenerationConfig given to the manager, else the default noted on the field".
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
    # Generation ends after this many tokens (None: GenerationConfig's, else DEFAULT_MAX_NEW_TOKENS).
    max_new_tokens: int | None = None
    # Any of these ends generation (None: the GenerationConfig's eos_token_id; () never stops early).
    stop_token_ids: tuple[int, ...] | None = None
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
    # Typical sampling: keep the locally typical tokens whose probability reaches typical_p; 1.0 disables.
    typical_p: float = 1.0
    # Drop tokens whose probability is below epsilon_cutoff (the top token always stays); 0 disables.
    epsilon_cutoff: float = 0.0
    # Eta sampling: an entropy-dependent epsilon, min(eta, sqrt(eta) * exp(-entropy)); 0 disables.
    eta_cutoff: float = 0.0
    # "processed": log-prob under the distribution actually sampled from; "raw": log_softmax of the model's logits;
    # "temperature_scaled": log_softmax(logits / temperature), what TRL and verl recompute in their losses.
    logprob_mode: Literal["processed", "raw", "temperature_scaled"] = "processed"
    # Also return the top-k log-probs (in the same mode) at every position; 0 disables.
    top_logprobs: int = 0

    def __post_init__(self) -> None:
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
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be a number > 0",
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
                _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
                "max_new_tokens",
                "must be an integer >= 1",
                self.max_new_tokens,
            )
        if self.stop_token_ids is not None:
            if _is_int(self.stop_token_ids):
                self.stop_token_ids = (self.stop_token_ids,)
            _check(
                isinstance(self.stop_token_ids, (list, tuple))
                and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "must be a list of non-negative token ids",
                self.stop_token_ids,
            )
            self.stop_token_ids = tuple(self.stop_token_ids)
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
        _check(_is_number(self.typical_p) and 0 < self.typical_p <= 1, "typical_p", "must be in (0, 1]", self.typical_p)
        for name in ("epsilon_cutoff", "eta_cutoff"):
            value = getattr(self, name)
            _check(_is_number(value) and 0 <= value < 1, name, "must be in [0, 1) (0 disables)", value)
        _check(isinstance(self.do_sample, bool), "do_sample", "must be a bool", self.do_sample)
        if self.seed is not None:
            _check(_is_int(self.seed), "seed", "must be an integer", self.seed)
        _check(self.logprob_mode in LOGPROB_MODES, "logprob_mode", f"must be one of {LOGPROB_MODES}", self.logprob_mode)
        _check(
            _is_int(self.top_logprobs) and 0 <= self.top_logprobs <= 100,
            "top_logprobs",
            "must be an integer in [0, 100]",
            self.top_logprobs,
        )

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0 or do_sample=False)."""
        return not self.do_sample or self.temperature == 0

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
        unknown = sorted(set(fields) - {item.name for item in dataclasses.fields(cls)})
        if unknown:
            raise FieldError(f"sampling.{unknown[0]}", f"unknown sampling field {unknown[0]!r}")
        try:
            return cls(**fields)
        except FieldError as error:
            raise FieldError(f"sampling.{error.field}", error.reason) from None


def _as_plain(value: Any) -> Any:
    return [_as_plain(item) for item in value] if isinstance(value, tuple | list) else value


ATTENTION_BACKENDS = ("auto", "torch", "triton")
# torch.compile modes that capture no CUDA graphs of their own ("reduce-overhead" and "max-autotune" do).
COMPILE_MODES_WITHOUT_GRAPHS = (None, "default", "max-autotune-no-cudagraphs")


@dataclass
class ContinuousBatchingConfig:
    """Engine settings: KV cache size, batch shape, scheduling policy, logprobs and queueing."""

    # Tokens per KV block. Smaller blocks share prefixes more finely; larger ones cut per-step metadata.
    block_size: int = 16
    # Number of KV blocks. None sizes the cache from max_memory_percent of free device memory.
    num_blocks: int | None = None
    # Most tokens (prefill chunks + decodes) computed in one engine step.
    max_batch_tokens: int = 2048
    # Most sequences in one engine step.
    max_num_seqs: int = 256
    # Fraction of free memory (after the model is loaded) given to the KV cache when num_blocks is None.
    # None: 0.9 on an accelerator, 0.05 of available RAM on CPU (CPU runs are for tests and examples).
    max_memory_percent: float | None = None
    # Reuse computed KV blocks across requests with the same prefix (and policy version).
    allow_block_sharing: bool = True
    # "fifo": running requests (decodes) first, then new prefills; "prefill_first": new prefills first.
    scheduler_type: str = "fifo"
    # Compute per-token log-probs for every request.
    return_logprobs: bool = True
    # GiB of CPU memory for swapping preempted requests' KV; 0 recomputes them instead.
    cpu_offload_space: float = 0.0
    # Most requests waiting to be scheduled (queued, not yet running); 0 means unbounded. A full queue is an error.
    max_queue_size: int = 0
    # Replay CUDA graphs for decode steps (one capture per bucketed batch size; `warmup()` captures them all ahead
    # of time). None: on CUDA whenever the Triton attention kernels serve it; True: insist (an error without the
    # kernels); False: eager. Never used on CPU.
    use_cuda_graph: bool | None = None
    # Schedule step N+1 while step N runs on the device: the host's scheduling and input building hide behind the
    # GPU's forward, and step N's tokens reach the host once, after N+1 was queued. A sample that stops at step N
    # wastes one row of step N+1. None: on CUDA; False: schedule after each step's tokens are on the host.
    # Outputs are the same either way.
    overlap_scheduling: bool | None = None
    # torch.compile settings (transformers' CompileConfig) for the decode forward, None: no compilation. With CUDA
    # graphs on, the compiled forward is what gets captured, so its mode must not capture graphs itself.
    decode_compile_config: CompileConfig | None = None
    # Paged attention kernels: "auto" (Triton on CUDA when it is installed and block_size is a power of two >= 16,
    # else PyTorch), "torch", or "triton" (on CPU only inside Triton's interpreter, TRITON_INTERPRET=1: for tests).
    attention_backend: str = "auto"
    # Compute the final projection (lm_head) and the softmax in fp32 even for a bf16/fp16 model: logprobs closer to
    # a trainer that does the same (TRL's cast_lm_head_to_fp32), for one fp32 copy of the lm_head weight per step.
    fp32_logits: bool = False
    # Longest prompt + generation accepted; None uses the model's max_position_embeddings.
    max_model_len: int | None = None
    # Seed of the seeds given to requests that bring none (None: fresh randomness), so a whole run can repeat.
    seed: int | None = None

    def __post_init__(self) -> None:
        _check(
            _is_int(self.block_size) and self.block_size >= 1, "block_size", "must be an integer >= 1", self.block_size
        )
        if self.num_blocks is not None:
            _check(
                _is_int(self.num_blocks) and self.num_blocks >= 1,
                "num_blocks",
                "must be an integer >= 1",
                self.num_blocks,
            )
        _check(
            _is_int(self.max_batch_tokens) and self.max_batch_tokens >= 1,
            "max_batch_tokens",
            "must be an integer >= 1",
            self.max_batch_tokens,
        )
        _check(
            _is_int(self.max_num_seqs) and self.max_num_seqs >= 1,
            "max_num_seqs",
            "must be an integer >= 1",
            self.max_num_seqs,
        )
        if self.max_memory_percent is not None:
            _check(
                _is_number(self.max_memory_percent) and 0 < self.max_memory_percent <= 1,
                "max_memory_percent",
                "must be in (0, 1]",
                self.max_memory_percent,
            )
        _check(
            isinstance(self.allow_block_sharing, bool),
            "allow_block_sharing",
            "must be a bool",
            self.allow_block_sharing,
        )
        _check(
            self.scheduler_type in SCHEDULER_TYPES,
            "scheduler_type",
            f"must be one of {SCHEDULER_TYPES}",
            self.scheduler_type,
        )
        _check(isinstance(self.return_logprobs, bool), "return_logprobs", "must be a bool", self.return_logprobs)
        _check(
            _is_number(self.cpu_offload_space) and self.cpu_offload_space >= 0,
            "cpu_offload_space",
            "must be >= 0 (GiB)",
            self.cpu_offload_space,
        )
        _check(
            _is_int(self.max_queue_size) and self.max_queue_size >= 0,
            "max_queue_size",
            "must be an integer >= 0 (0: unbounded)",
            self.max_queue_size,
        )
        _check(
            self.use_cuda_graph is None or isinstance(self.use_cuda_graph, bool),
            "use_cuda_graph",
            "must be None (auto) or a bool",
            self.use_cuda_graph,
        )
        _check(
            self.overlap_scheduling is None or isinstance(self.overlap_scheduling, bool),
            "overlap_scheduling",
            "must be None (auto) or a bool",
            self.overlap_scheduling,
        )
        if self.decode_compile_config is not None:
            from transformers import CompileConfig

            _check(
                isinstance(self.decode_compile_config, CompileConfig),
                "decode_compile_config",
                "must be a transformers.CompileConfig or None",
                self.decode_compile_config,
            )
            compile_config = self.decode_compile_config
            _check(
                compile_config.options is None or compile_config.mode is None,
                "decode_compile_config",
                "torch.compile takes mode or options, not both: set mode=None when giving options",
                compile_config.mode,
            )
            _check(
                self.use_cuda_graph is False or not (compile_config.options or {}).get("triton.cudagraphs"),
                "decode_compile_config",
                "options 'triton.cudagraphs' captures graphs itself while use_cuda_graph may (set it False)",
                compile_config.options,
            )
            _check(
                self.use_cuda_graph is False or compile_config.mode in COMPILE_MODES_WITHOUT_GRAPHS,
                "decode_compile_config",
                f"mode must be one of {COMPILE_MODES_WITHOUT_GRAPHS} while use_cuda_graph may capture graphs itself "
                "(or set use_cuda_graph=False)",
                self.decode_compile_config.mode,
            )
        _check(isinstance(self.fp32_logits, bool), "fp32_logits", "must be a bool", self.fp32_logits)
        _check(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {ATTENTION_BACKENDS}",
            self.attention_backend,
        )
        if self.max_model_len is not None:
            _check(
                _is_int(self.max_model_len) and self.max_model_len >= 2,
                "max_model_len",
                "must be an integer >= 2",
                self.max_model_len,
            )
        if self.seed is not None:
            _check(_is_int(self.seed), "seed", "must be an integer or None", self.seed)
