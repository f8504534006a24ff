"""transformers' `GenerationConfig`, resolved into rollout's request defaults as transformers' `generate` resolves it:
each field takes its value from the caller's config, else the model's own (`model.generation_config`), else
transformers' global default.

Every field is honoured, has no effect on which tokens are produced (and is accepted), or is refused with a
`FieldError` naming it when it is set to anything but transformers' default: rollout never silently ignores a field
that would change the output (beam search, assistant models, watermarking, ...). A field this module does not know
(a newer transformers, or a typo) is refused the same way in the caller's config; in the model's own config, entries
that are no GenerationConfig field at all (a checkpoint's custom keys such as `chat_format`) are ignored, as
`generate` ignores them.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

from rollout.config import FieldError, SamplingParams

# GenerationConfig field -> SamplingParams field of the same meaning.
HONOURED = {
    name: name
    for name in (
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "do_sample",
        "max_new_tokens",
        "min_new_tokens",
        "no_repeat_ngram_size",
        "suppress_tokens",
        "begin_suppress_tokens",
        "typical_p",
        "epsilon_cutoff",
        "eta_cutoff",
    )
} | {"eos_token_id": "stop_token_ids", "bad_words_ids": "bad_words_ids", "stop_strings": "stop"}
# Honoured outside SamplingParams (see GenerationDefaults).
HONOURED_ELSEWHERE = ("num_return_sequences", "max_length", "continuous_batching_config")
# Fields that do not change which tokens are generated, with the reason.
NO_EFFECT = {
    "pad_token_id": "rollout batches without padding",
    "bos_token_id": "the prompt is given as token ids",
    "decoder_start_token_id": "decoder-only models",
    "output_scores": "rollout always returns per-token logprobs (return_logprobs)",
    "output_logits": "logits are not returned; per-token logprobs are",
    "output_attentions": "attentions are not returned",
    "output_hidden_states": "hidden states are not returned",
    "return_dict_in_generate": "outputs are GenerationOutput objects",
    "renormalize_logits": "rollout's logprobs are always normalised",
    "use_cache": "rollout always uses its paged KV cache",
    "cache_implementation": "rollout always uses its paged KV cache",
    "cache_config": "rollout always uses its paged KV cache",
    "max_cache_len": "rollout always uses its paged KV cache",
    "compile_config": "set ContinuousBatchingConfig.decode_compile_config",
    "disable_compile": "set ContinuousBatchingConfig.decode_compile_config",
    "prefill_chunk_size": "the token budget (max_batch_tokens) chunks prefills; tokens are the same",
    "low_memory": "beam search only",
    "length_penalty": "beam search only",
    "early_stopping": "beam search only",
    "num_assistant_tokens": "used only with an assistant model",
    "num_assistant_tokens_schedule": "used only with an assistant model",
    "assistant_confidence_threshold": "used only with an assistant model",
    "assistant_lookbehind": "used only with an assistant model",
    "target_lookbehind": "used only with an assistant model",
    "is_assistant": "marks a config as an assistant's",
    "transformers_version": "metadata",
}
# transformers' global defaults (GenerationConfig._get_default_generation_params in transformers 5.23): a field at
# its default changes nothing, so even a refused field may carry it.
TRANSFORMERS_DEFAULTS = {
    "max_length": 20,
    "min_length": 0,
    "do_sample": False,
    "use_cache": True,
    "early_stopping": False,
    "num_beams": 1,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "typical_p": 1.0,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "num_return_sequences": 1,
    "output_scores": False,
    "return_dict_in_generate": False,
    "remove_invalid_values": False,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "encoder_repetition_penalty": 1.0,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "guidance_scale": 1.0,
    "token_healing": False,
    "use_mtp": False,
}
# Why some refused fields are refused (others: "not supported by rollout").
REFUSAL_REASONS = {
    "num_beams": "beam search is not supported; sample n completions with num_return_sequences",
    "num_beam_groups": "beam search is not supported",
    "diversity_penalty": "beam search is not supported",
    "penalty_alpha": "contrastive search is not supported",
    "dola_layers": "DoLa decoding is not supported",
    "min_length": "counts the prompt; use min_new_tokens",
    "watermarking_config": "watermarking is not supported",
    "prompt_lookup_num_tokens": "prompt-lookup decoding is not supported; drafts from a prompt's samples: speculative='suffix'",
    "max_matching_ngram_size": "prompt-lookup decoding is not supported; drafts from a prompt's samples: speculative='suffix'",
    "assistant_early_exit": "assisted decoding is not supported",
    "speculation_type": "transformers' speculation is not supported; rollout's: ContinuousBatchingConfig(speculative='suffix')",
    "max_time": "a wall-clock limit is not supported; use max_new_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    """What a GenerationConfig sets for requests that do not say otherwise."""

    sampling: SamplingParams
    n: int  # samples per prompt (num_return_sequences)
    max_length: int | None  # prompt + generated tokens, used when no max_new_tokens is set anywhere
    continuous_batching_config: Any  # carried by the GenerationConfig; used when none is passed explicitly
    # The sampling settings the caller's own GenerationConfig set (SamplingParams field -> value): a request that
    # brings its own SamplingParams does not use them (only stop tokens and max_new_tokens are merged), and is told.
    caller_sampling: dict[str, Any] = field(default_factory=dict)


def resolve(
    generation_config: Any = None, model_generation_config: Any = None, vocab_size: int | None = None
) -> GenerationDefaults:
    """The request defaults of `generation_config` over `model_generation_config`, as `generate` resolves them.

    Args:
        generation_config: the caller's `transformers.GenerationConfig` (or None).
        model_generation_config: the model's own (`model.generation_config`, or None).
        vocab_size: the model's vocabulary size: token ids the configs give (`eos_token_id`, `suppress_tokens`,
            `begin_suppress_tokens`, `bad_words_ids`) must be below it (None: not checked here).
    Raises:
        FieldError: a field set to a value rollout cannot honour, named "generation_config.<field>" or
            "model.generation_config.<field>" after the config it came from.
    """
    from transformers import GenerationConfig

    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        kind = type(generation_config).__name__
        reason = f"expected a transformers GenerationConfig (GenerationConfig(**fields)), got {kind}"
        raise FieldError("generation_config", reason)
    values: dict[str, tuple[str, Any]] = {}  # field -> (which config set it, value)
    for label, config in (
        ("generation_config", generation_config),
        ("model.generation_config", model_generation_config),
    ):
        for name, value in _fields(config).items():
            if value is not None and name not in values:
                values[name] = (label, value)
    standard = _standard_fields()
    for name, (label, value) in values.items():
        known = name in HONOURED or name in HONOURED_ELSEWHERE or name in NO_EFFECT
        if label == "model.generation_config" and name not in standard:
            continue  # a checkpoint's custom entry (chat_format, ...): generate ignores it too
        if not known and value != TRANSFORMERS_DEFAULTS.get(name):
            reason = REFUSAL_REASONS.get(name, "not supported by rollout")
            raise FieldError(f"{label}.{name}", f"{value!r} is invalid: {reason}")

    def named(name: str, reason: str) -> FieldError:
        return FieldError(f"{values[name][0]}.{name}" if name in values else name, reason)

    sampling: dict[str, Any] = {}
    for name, target in HONOURED.items():
        value = values[name][1] if name in values else TRANSFORMERS_DEFAULTS.get(name)
        if value is not None:
            sampling[target] = eos_ids(value) if name == "eos_token_id" else value
    if sampling.get("stop"):
        # generate's StopStringCriteria reads every token's text, special tokens' included: a special token between
        # two pieces of a stop string keeps them apart there, and so here.
        sampling["skip_special_tokens"] = False
    top_k = sampling.get("top_k")
    if vocab_size is not None and type(top_k) is int and top_k > vocab_size:
        # generate's TopKLogitsWarper keeps min(top_k, vocabulary) tokens: transformers' default top_k=50 samples a
        # model of a smaller vocabulary from all of it (SamplingParams refuses a top_k over the vocabulary)
        sampling["top_k"] = vocab_size
    if vocab_size is not None and values.get("eos_token_id", ("",))[0] == "model.generation_config":
        sampling["stop_token_ids"] = _reachable_eos(sampling["stop_token_ids"], vocab_size)
    try:
        params = SamplingParams(**sampling)
    except FieldError as error:  # name the GenerationConfig field and its config, not the SamplingParams field
        source = next((name for name, target in HONOURED.items() if target == error.field), error.field)
        raise named(source, error.reason) from None
    if vocab_size is not None:  # refused here, by the config's name, not at each request under SamplingParams'
        for name, tokens in _token_fields(params).items():
            outside = sorted({t for t in tokens if t >= vocab_size})
            if outside:
                raise named(name, f"{outside} outside the model's vocabulary [0, {vocab_size})")
    n = _value(values, "num_return_sequences", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise named("num_return_sequences", f"{n!r} is invalid: must be an integer >= 1")
    max_length = _value(values, "max_length", None)
    if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2):
        raise named("max_length", f"{max_length!r} is invalid: must be an integer >= 2")
    merged = ("eos_token_id", "max_new_tokens")  # what a request's own SamplingParams still takes from the config
    caller = {
        target: getattr(params, target)
        for name, target in HONOURED.items()
        if name not in merged and values.get(name, ("",))[0] == "generation_config"
        and values[name][1] != TRANSFORMERS_DEFAULTS.get(name)
    }  # fmt: skip
    return GenerationDefaults(params, n, max_length, _value(values, "continuous_batching_config", None), caller)


def _reachable_eos(stops: Any, vocab_size: int) -> Any:
    """A model's own EOS ids without those outside its vocabulary, with a warning: no token can ever match them, so
    `generate` runs such a model (a tiny one built from a config with a vocabulary smaller than its EOS, say) as if
    they were not set, and only warns. A caller's own GenerationConfig is refused instead (a likely mistake)."""
    if not isinstance(stops, list) or not all(isinstance(token, int) for token in stops):
        return stops  # SamplingParams names what is wrong
    outside = [token for token in stops if token >= vocab_size]
    if outside:
        warnings.warn(
            f"model.generation_config.eos_token_id {outside} is outside the model's vocabulary [0, {vocab_size}): "
            "no token can match it, so it does not end any sample (as in generate)",
            UserWarning,
            stacklevel=4,
        )
    return [token for token in stops if token < vocab_size]


def _token_fields(params: SamplingParams) -> dict[str, list[int]]:
    """The token ids `params` took from a GenerationConfig, by the GenerationConfig field that gave them."""
    return {
        "eos_token_id": list(params.stop_token_ids or ()),
        "suppress_tokens": list(params.suppress_tokens),
        "begin_suppress_tokens": list(params.begin_suppress_tokens),
        "bad_words_ids": [token for word in params.bad_words_ids for token in word],
    }


def eos_ids(eos_token_id: Any) -> Any:
    """transformers' `eos_token_id` (an id or a list) as a list of stop token ids, negative ids dropped: transformers'
    continuous batching reads them as "no EOS" (its `init_continuous_batching` writes -1 into a GenerationConfig that
    has none, its own `model.generation_config` included) and `generate` never matches them. Anything that is not
    an int is kept for SamplingParams' validation to name.

    Args:
        eos_token_id: an int, a list / tuple of ints, or anything else (returned in a list, unchecked).
    """
    ids = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    return [i for i in ids if not (isinstance(i, int) and not isinstance(i, bool) and i < 0)]


@functools.cache
def _standard_fields() -> frozenset[str]:
    """The fields of the installed transformers' GenerationConfig (anything else on a config is a custom entry)."""
    from transformers import GenerationConfig

    return frozenset(_fields(GenerationConfig()))


def _value(values: dict[str, tuple[str, Any]], name: str, default: Any) -> Any:
    return values[name][1] if name in values else default


def _fields(config: Any) -> dict[str, Any]:
    """The public fields of a GenerationConfig, set or not (None when not); nothing for None."""
    if config is None:
        return {}
    return {name: value for name, value in vars(config).items() if not name.startswith("_")}
