"""What a chat request may hand the tokenizer's chat template: template variables only, and no more text than a
prompt can hold.

`chat_template_kwargs` reaches `apply_chat_template`, whose own parameters are tokenizer and rendering options
(`padding="max_length", max_length=10**9` allocates gigabytes before any check; `truncation=True` silently cuts
the prompt). Only the names that are not its parameters are template variables (`enable_thinking`, ...), plus
`documents`; the others are refused by name. Everything the template renders (messages, tools, documents,
variables) counts toward the prompt's character cap, measured before any tokenizing.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from rollout.service.http.errors import APIError, bad_field

# Template variables one request may set: chat templates read a handful (enable_thinking, ...); 200,000 of them
# hold the interpreter lock for seconds while they are copied and measured.
MAX_TEMPLATE_VARIABLES = 256
# Parameters of apply_chat_template (and the template's own `messages`) that a request sets through its own
# top-level fields.
TOP_LEVEL = {
    "conversation": "messages",
    "messages": "messages",  # (not a parameter: what the template renders the conversation as)
    "tools": "tools",
    "add_generation_prompt": "add_generation_prompt",
    "continue_final_message": "continue_final_message",
}
# Parameters of apply_chat_template that are template inputs (chat_template only with --trust-request-chat-template;
# a request may also give it as its top-level `chat_template` field, as vLLM takes it).
TEMPLATE_INPUTS = {"documents", "chat_template"}
# Always refused, whatever the installed transformers' signature says (older ones took some as **kwargs).
TOKENIZER_OPTIONS = {
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "processor_kwargs",
    "sanitize_control_tokens",
    "add_special_tokens",
    "pad_to_multiple_of",
    "return_attention_mask",
}


# The longest chat template a trusted request may bring (gpt-oss's is about 15,000 characters): a template is code,
# not prompt text, so it is held to this rather than to the prompt's character cap.
MAX_CHAT_TEMPLATE_CHARS = 256_000

UNTRUSTED = (
    "a request's own chat template runs on the worker: refused unless it runs with --trust-request-chat-template"
)


def template_variables(
    kwargs: Any, tokenizer: Any, trust_request_chat_template: bool, chat_template: Any = None
) -> dict[str, Any]:
    """The request's `chat_template_kwargs`, checked: template variables (and `documents`) only; with the request's
    top-level `chat_template` (vLLM's field) as its `chat_template`.

    Args:
        kwargs: the field's value (None: none).
        tokenizer: the worker's tokenizer (its `apply_chat_template` parameters are refused).
        trust_request_chat_template: a request may bring its own `chat_template` (code the worker runs).
        chat_template: the request's top-level `chat_template` (None: none).

    Raises:
        APIError: not an object, or naming the first tokenizer option, top-level field or untrusted template in it;
            a top-level `chat_template` untrusted, not a string, or other than the one in `chat_template_kwargs`.
    """
    kwargs = _checked_kwargs(kwargs, tokenizer, trust_request_chat_template)
    if "chat_template" in kwargs:
        reason = _template_refusal(kwargs["chat_template"])
        if reason is not None:
            raise _bad_key("chat_template", reason)
    if chat_template is None:
        return kwargs
    if not trust_request_chat_template:
        raise bad_field("chat_template", UNTRUSTED)
    reason = _template_refusal(chat_template)
    if reason is not None:
        raise bad_field("chat_template", reason)
    if "chat_template" in kwargs and kwargs["chat_template"] != chat_template:
        raise bad_field("chat_template", "differs from chat_template_kwargs.chat_template: give one of them")
    return {**kwargs, "chat_template": chat_template}


def _template_refusal(template: Any) -> str | None:
    """Why a request's chat template cannot be used (None: it can)."""
    if not isinstance(template, str):
        return f"must be a string (a Jinja template), got {type(template).__name__}"
    if not template.strip():
        return "is empty: give a Jinja template, or leave the field out for the tokenizer's own"
    if len(template) > MAX_CHAT_TEMPLATE_CHARS:
        return (
            f"is {len(template):,} characters; a request's chat template may hold at most {MAX_CHAT_TEMPLATE_CHARS:,}"
        )
    return None


def _checked_kwargs(kwargs: Any, tokenizer: Any, trust_request_chat_template: bool) -> dict[str, Any]:
    """`chat_template_kwargs` checked (`template_variables`, without the top-level template)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad_field("chat_template_kwargs", "must be an object")
    if len(kwargs) > MAX_TEMPLATE_VARIABLES:
        reason = f"{len(kwargs)} variables; a request may set at most {MAX_TEMPLATE_VARIABLES}"
        raise bad_field("chat_template_kwargs", reason)
    options = _tokenizer_options(tokenizer)
    for name in sorted(kwargs):
        if name in TOP_LEVEL:
            raise _bad_key(name, f"set it as the request's `{TOP_LEVEL[name]}` field")
        if name in options:
            reason = "a tokenizer or rendering option, not a template variable (only template variables may pass)"
            raise _bad_key(name, reason)
    if "chat_template" in kwargs and not trust_request_chat_template:
        raise _bad_key("chat_template", UNTRUSTED)
    return kwargs


def check_rendered_size(parts: dict[str, Any], max_chars: int, max_prompt_len: int) -> None:
    """Refuse a chat request whose template inputs hold more text than any prompt can.

    Every input counts as its JSON text (keys and punctuation included: a template may render any of them), so a
    huge tool description, document or variable is refused before a single token is made.

    Args:
        parts: field name -> value, for each input the template renders (messages, tools, chat_template_kwargs).
        max_chars: most characters a request's template inputs may hold.
        max_prompt_len: the longest prompt in tokens (for the message).

    Raises:
        APIError: 400 `context_length_exceeded` naming the field that tipped it over.
    """
    total = 0
    for name, value in parts.items():
        if value is None:
            continue
        try:
            total += len(json.dumps(value, ensure_ascii=False, default=str))
        except RecursionError:
            raise bad_field(name, "nested too deeply") from None
        if total > max_chars:
            reason = f"the chat template's inputs hold over {max_chars} characters, more than the {max_prompt_len} tokens a prompt may have"
            raise APIError(400, f"{name}: {reason}", name, code="context_length_exceeded")


def _bad_key(key: str, reason: str) -> APIError:
    """A 400 for one key of chat_template_kwargs (the field is the param; the message names the key)."""
    return APIError(400, f"chat_template_kwargs.{key}: {reason}", "chat_template_kwargs")


def _tokenizer_options(tokenizer: Any) -> set[str]:
    """The parameters of the tokenizer's apply_chat_template that are not template inputs."""
    try:
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    except (TypeError, ValueError, AttributeError):
        parameters = ()
    own = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return (own | TOKENIZER_OPTIONS) - TEMPLATE_INPUTS - set(TOP_LEVEL)
