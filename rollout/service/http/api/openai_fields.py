"""OpenAI / vLLM request bodies -> what the engine takes: prompts as token ids, a `SamplingParams`, `n`.

Every field of a body is honoured, has no effect on the tokens (and is accepted: `NO_EFFECT_FIELDS`), or is refused
with a 400 naming it; an unknown field is refused too, never silently dropped. `REFUSED` lists the OpenAI
fields rollout does not serve.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from rollout.config import FieldError, SamplingParams
from rollout.service.http.api.structured_fields import client_param, refuse_legacy_fields, structured_request
from rollout.service.http.errors import APIError, bad_field, from_field_error

# Sampling fields both endpoints take, by their OpenAI / vLLM names -> SamplingParams fields.
OPENAI_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "min_tokens": "min_new_tokens",
    "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "logprob_mode": "logprob_mode",  # rollout's: which distribution log-probs come from (docs/concepts/logprobs.md)
    "logit_bias": "logit_bias",  # token id (a JSON string key) -> bias in [-100, 100], at most 300 of them
    "return_routed_experts": "return_routes",  # MoE models: each choice's routed_experts (SGLang's and vLLM's name)
}
# Sampling fields a request that leaves them out takes from the model's own generation config (those it sets apart
# from transformers' defaults: a checkpoint's generation_config.json), as vLLM's `--generation-config auto`, its
# default, takes them; a field the model's config does not set keeps OpenAI's default.
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# OpenAI request fields that carry no generation semantics: accepted, with no effect (docs/guides/openai.md).
NO_EFFECT_FIELDS = {
    "user",  # an end-user id for the caller's own records
    "safety_identifier",  # the same, by OpenAI's newer name
    "metadata",  # tags for the caller's stored completions
    "store",  # whether OpenAI stores the completion (rollout stores nothing)
    "service_tier",  # OpenAI's processing tier
    "prompt_cache_key",  # a hint for OpenAI's prompt cache (rollout's prefix cache needs none)
}
# Fields both endpoints take that are handled outside SamplingParams.
COMMON_FIELDS = (
    {
        "model",
        "n",
        "max_tokens",
        "stream",
        "stream_options",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "return_token_ids",
        "response_format",  # OpenAI's structured outputs (structured_fields)
        "structured_outputs",  # vLLM's
    }
    | set(OPENAI_SAMPLING_FIELDS)
    | NO_EFFECT_FIELDS
)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "prompt_logprobs", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template",  # vLLM's: the request's own template (with --trust-request-chat-template)
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
}
# Fields refused unless absent, null or one of their harmless values, and why (clients such as the openai package's
# may send them as null).
REFUSED = {
    "suffix": (("",), "insertion (suffix) is not supported"),
    "reasoning_effort": ((), "is not supported (a chat template's own settings go in chat_template_kwargs)"),
    "verbosity": ((), "is not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "audio": ((), "audio output is not supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    "functions": ((), "the legacy function calling is not supported: send tools"),
    "function_call": ((), "the legacy function calling is not supported: send tool_choice"),
}
CHAT_FIELDS |= set(REFUSED) - {"suffix"}  # known to chat, so that a null is accepted and a value refused by name


@dataclass
class GenerationRequest:
    """One request, ready for the engine.

    Attributes:
        prompts: token ids of each prompt (a batch for /v1/completions; one for chat).
        sampling: how every sample is drawn (max_new_tokens set).
        n: samples per prompt.
        stream: answer with server-sent events.
        include_usage: streaming: a last chunk with token counts.
        logprobs: top log-probs per token to return (0: only the sampled token's), or None: no logprobs.
        return_token_ids: each choice carries prompt_token_ids and token_ids.
        scoring: completions' echo and prompt_logprobs (None: chat, which has neither).
    """

    prompts: list[list[int]]
    sampling: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    return_token_ids: bool = False
    scoring: Any = None  # completions: echo and prompt_logprobs (prompt_scoring.PromptScoring)


def check_fields(body: Any, known: set[str]) -> dict[str, Any]:
    """The body as a dict, or a 400 for a non-object body or a field this endpoint does not know."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    refuse_legacy_fields(body)
    unknown = sorted(set(body) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise bad_field(unknown[0], f"unknown field (rollout refuses fields it would otherwise ignore){hint}")
    for name, (harmless, why) in REFUSED.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(h) and value == h for h in harmless):
            raise bad_field(name, why)
    for name in ("parallel_tool_calls", "store"):  # the first call only when false (chat_tools), or nothing to store
        flag(body, name)
    for name, kind in (
        ("user", str),
        ("safety_identifier", str),
        ("prompt_cache_key", str),
        ("service_tier", str),
        ("metadata", dict),
    ):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise bad_field(name, f"must be a {'string' if kind is str else 'JSON object'}")
    return body


def model_sampling_defaults(model: Any, vocab_size: int) -> dict[str, Any]:
    """The `MODEL_DEFAULT_FIELDS` the model's generation config sets apart from transformers' defaults, by their
    request names: what a request that leaves them out samples with (vLLM's `--generation-config auto`).

    Args:
        model: the served model (its `generation_config`; none: no defaults).
        vocab_size: the model's vocabulary (a larger top_k keeps all of it, as `generate` keeps it).
    """
    config = getattr(model, "generation_config", None)
    diff = config.to_diff_dict() if hasattr(config, "to_diff_dict") else {}
    defaults = {name: diff[name] for name in MODEL_DEFAULT_FIELDS if diff.get(name) is not None}
    if type(defaults.get("top_k")) is int and defaults["top_k"] > vocab_size:
        defaults["top_k"] = vocab_size
    return defaults


def sampling_from(
    body: dict[str, Any],
    default_stops: tuple[int, ...],
    max_tokens: int,
    top_logprobs: int,
    prompt_field: str,
    prompt_logprobs: int | None = None,
    model_defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """The SamplingParams of a body (a 400 naming the body's field when one is bad).

    Args:
        body: the request body (fields already checked by `check_fields`).
        default_stops: the model's EOS tokens (stop unless `ignore_eos`; `stop_token_ids` add to them).
        max_tokens: the request's resolved max_tokens.
        top_logprobs: top log-probs per token to compute.
        prompt_field: "prompt" or "messages" (where prompt errors point).
        prompt_logprobs: top log-probs per prompt position to compute (None: the prompt is not scored).
        model_defaults: what the request takes where it leaves a field out or null (`model_sampling_defaults`).
    """
    given = {**(model_defaults or {}), **{name: value for name, value in body.items() if value is not None}}
    fields: dict[str, Any] = {
        target: given[name] for name, target in OPENAI_SAMPLING_FIELDS.items() if given.get(name) is not None
    }
    top_k = fields.get("top_k")
    if top_k == -1 and not isinstance(top_k, bool):  # vLLM's "disabled"
        fields["top_k"] = 0
    elif isinstance(top_k, int) and not isinstance(top_k, bool) and top_k < -1:  # SamplingParams would say ">= 0"
        raise bad_field("top_k", f"must be -1 or 0 (disabled) or a positive integer, got {top_k}")
    ignore_eos = flag(body, "ignore_eos")
    extra_stops = body.get("stop_token_ids")
    extra_stops = [] if extra_stops is None else extra_stops
    if not isinstance(extra_stops, list):
        raise bad_field("stop_token_ids", "must be a list of token ids")
    for token in extra_stops:  # named as sent (the list checked later holds the model's EOS tokens too)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise bad_field("stop_token_ids", f"must be a list of token ids (integers >= 0), got {token!r} in it")
    min_tokens = body.get("min_tokens")
    if min_tokens is not None and integer(body, "min_tokens", 0, 0) > max_tokens:
        raise bad_field("min_tokens", f"must be at most max_tokens ({max_tokens})")
    stops = [] if ignore_eos else list(default_stops)
    fields["stop_token_ids"] = stops + [t for t in extra_stops if t not in stops]
    stop = body.get("stop")
    if stop is not None:
        fields["stop"] = [stop] if isinstance(stop, str) else stop
    fields.update(max_new_tokens=max_tokens, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs)
    structured = structured_request(body)
    fields.update(structured.fields)
    try:
        return SamplingParams(**fields)
    except FieldError as error:
        reverse = {target: name for name, target in OPENAI_SAMPLING_FIELDS.items()}
        name = client_param(structured, error.field) or reverse.get(error.field, error.field)
        raise from_field_error(FieldError(name, error.reason), prompt_field) from None


def integer(body: dict[str, Any], name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    """An integer field in [low, high] (None or absent: `default`), or a 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad_field(name, f"must be an integer {bounds}, got {value!r}")
    return value


def stream_settings(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) of a body."""
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise bad_field("stream_options", "only include_usage is supported")
    if not stream:
        raise bad_field("stream_options", "only allowed with stream=true")
    if options.get("continuous_usage_stats"):
        raise bad_field("stream_options", "continuous_usage_stats is not supported")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_field("stream_options", f"include_usage must be a boolean, got {include_usage!r}")
    return stream, include_usage


def flag(body: dict[str, Any], name: str) -> bool:
    """A boolean field (None or absent: False), or a 400 naming it."""
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_field(name, f"must be a boolean, got {value!r}")
    return value
