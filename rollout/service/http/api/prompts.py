"""The prompts of HTTP requests as token ids: /v1/completions' `prompt` (text or token ids, one or a batch) and
/v1/chat/completions' `messages`, rendered by the tokenizer's own chat template (`apply_chat_template`, with `tools`
and `chat_template_kwargs` passed through), so the ids are exactly what the trainer's tokenizer makes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout.service.http.api.template_inputs import check_rendered_size, template_variables
from rollout.service.http.errors import APIError, bad_field
from rollout.service.http.tools.replayed_calls import ReplayedCallError, template_tool_calls
from rollout.service.http.tools.tool_calls import ToolsError, ToolSpec, check_tools
from rollout.validation import all_plain_ints, lone_surrogate

MAX_BATCH = 1024  # prompts in one /v1/completions request
MAX_TOOLS = 128  # tools in one chat request (OpenAI's own limit)
# The roles whose messages must have content (an assistant's may be its tool calls alone; any other role a template
# knows, e.g. "ipython", is passed through, as vLLM does).
CONTENT_ROLES = frozenset({"system", "developer", "user", "tool"})
# Text longer than this many characters per token of the longest prompt is refused before it is tokenized (no
# tokenizer makes tokens that long on ordinary text), so that a huge text cannot tie the worker up tokenizing it.
MAX_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class PromptLimits:
    """What a request's prompts may be.

    Attributes:
        max_prompt_len: longest prompt in tokens (text longer than MAX_CHARS_PER_TOKEN times it is refused unread).
        trust_request_chat_template: a request may bring its own chat template (`chat_template`, or in
            `chat_template_kwargs`).
    """

    max_prompt_len: int
    trust_request_chat_template: bool = False

    @property
    def max_chars(self) -> int:
        """Most characters of text a request's prompt may have."""
        return self.max_prompt_len * MAX_CHARS_PER_TOKEN


def completion_prompts(body: dict[str, Any], tokenizer: Any, limits: PromptLimits) -> list[list[int]]:
    """The prompts of a completions body: a string, a list of token ids, or a list of either.

    Raises:
        APIError: no prompt, an empty one, a malformed one or text too long for any prompt (param "prompt").
    """
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [_encode(tokenizer, prompt, limits)]
    if not isinstance(prompt, list) or not prompt:
        raise bad_field("prompt", "must be a string, a list of token ids, or a non-empty list of either")
    if all_plain_ints(prompt):
        return [_capped(list(prompt), limits)]
    if len(prompt) > MAX_BATCH:
        raise bad_field("prompt", f"at most {MAX_BATCH} prompts per request, got {len(prompt)}")
    prompts = []
    # Each prompt is checked as soon as it is read: a batch of over-long prompts is refused at its first one,
    # before the rest are tokenized.
    for index, item in enumerate(prompt):
        if isinstance(item, str):
            try:
                prompts.append(_encode(tokenizer, item, limits))
            except APIError as error:  # which prompt of the batch it was
                error.message = f"prompt: item {index} of the batch: {error.message.removeprefix('prompt: ')}"
                raise
        elif isinstance(item, list) and item and all_plain_ints(_capped(item, limits)):
            prompts.append(list(item))
        else:
            raise bad_field("prompt", f"item {index} is neither a string nor a non-empty list of token ids")
    return prompts


def chat_prompt(body: dict[str, Any], tokenizer: Any, limits: PromptLimits) -> list[int]:
    """The token ids of a chat body's `messages`, rendered with the tokenizer's chat template.

    Raises:
        APIError: malformed messages, tools or template arguments, a template that fails on them, or text too long
            for any prompt.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "must be a non-empty list of messages")
    rendered = [_message(index, message) for index, message in enumerate(messages)]
    tools = tool_spec(body).tools or None
    trusted = limits.trust_request_chat_template
    kwargs = template_variables(body.get("chat_template_kwargs"), tokenizer, trusted, body.get("chat_template"))
    # The template itself is code, held to its own limit (`template_variables`), not counted as prompt text.
    variables = {name: value for name, value in kwargs.items() if name != "chat_template"}
    inputs = {"messages": rendered, "tools": tools, "chat_template_kwargs": variables}
    check_rendered_size(inputs, limits.max_chars, limits.max_prompt_len)
    add_generation_prompt = body.get("add_generation_prompt", True)
    continue_final = body.get("continue_final_message", False)
    for name, value in (("add_generation_prompt", add_generation_prompt), ("continue_final_message", continue_final)):
        if not isinstance(value, bool):
            raise bad_field(name, f"must be a boolean, got {value!r}")
    if add_generation_prompt and continue_final:
        raise bad_field("continue_final_message", "cannot be combined with add_generation_prompt=true")
    if _chat_template(tokenizer) is None and "chat_template" not in kwargs:
        raise bad_field(
            "messages",
            "the worker's tokenizer has no chat template: restart the worker with --tokenizer naming one that has "
            "(the instruct model's), or send the rendered prompt to /v1/completions",
        )
    try:
        encoded = tokenizer.apply_chat_template(
            rendered,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            tokenize=True,
            return_dict=True,
            **kwargs,
        )
    except Exception as error:  # noqa: BLE001 - a template's own errors (jinja, ValueError) are the request's fault
        raise bad_field("messages", f"the chat template failed: {type(error).__name__}: {str(error)[:300]}") from None
    return list(encoded["input_ids"])


def tool_spec(body: dict[str, Any]) -> ToolSpec:
    """A chat body's `tools` and `tool_choice`, checked (a 400 naming the field, and the part of it at fault)."""
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise bad_field("tools", f"{len(tools)} tools; a request may have at most {MAX_TOOLS} (as OpenAI's API)")
    try:
        return check_tools(body.get("tools"), body.get("tool_choice"))
    except ToolsError as error:
        param = "tool_choice" if error.field.startswith("tool_choice") else "tools"
        raise APIError(400, str(error), param) from None


def needs_tokenizer(tokenizer: Any, what: str) -> None:
    """A 400 when the worker serves no tokenizer."""
    if tokenizer is None:
        raise APIError(400, f"{what} needs a tokenizer, and this worker has none (start it with --tokenizer)")


def _message(index: int, message: Any) -> dict[str, Any]:
    """A message for the template, as vLLM hands it over: text content parts joined into one string with newlines
    (OpenAI's list form), an assistant's replayed `tool_calls` with their arguments as mappings
    (`template_tool_calls`). Its other fields go to the template as they are (a template may read its own: gpt-oss's
    `thinking`; a client echoing an answer's message sends `refusal`, `parsed`, ...). A message of a role that speaks
    needs content (a template would render a missing one as "None" or nothing). The request's body is not changed."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_field("messages", f"message {index} must be an object with a string role")
    content = message.get("content")
    if content is None and message["role"] in CONTENT_ROLES:
        raise bad_field("messages", f"message {index}: a {message['role']} message needs content")
    if message["role"] == "assistant" and message.get("tool_calls") is not None:  # (null: as it came, as vLLM)
        try:
            calls = template_tool_calls(message["tool_calls"])
        except ReplayedCallError as error:
            raise bad_field("messages", f"message {index}: {error}") from None
        message = {name: value for name, value in message.items() if name != "tool_calls"}
        if calls is not None:
            message["tool_calls"] = calls
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise bad_field("messages", f"message {index}: only text content parts are supported")
        message = {**message, "content": "\n".join(part["text"] for part in content)}
    elif content is not None and not isinstance(content, str):
        raise bad_field("messages", f"message {index}: content must be a string or a list of text parts")
    if isinstance(message.get("content"), str):
        _refuse_lone_surrogate("messages", message["content"], f"message {index}'s content ")
    return message


def _encode(tokenizer: Any, text: str, limits: PromptLimits) -> list[int]:
    if len(text) > limits.max_chars:
        _too_long("prompt", len(text), limits)
    _refuse_lone_surrogate("prompt", text)
    try:
        ids = list(tokenizer(text)["input_ids"])
    except Exception as error:  # noqa: BLE001 - text the tokenizer cannot take (a lone surrogate, ...)
        raise bad_field(
            "prompt", f"the tokenizer cannot encode it: {type(error).__name__}: {str(error)[:300]}"
        ) from None
    if not ids:
        raise bad_field("prompt", "encodes to no tokens")
    return _capped(ids, limits)


def _refuse_lone_surrogate(field: str, text: str, where: str = "") -> None:
    """A 400 naming `field` when `text` holds a lone surrogate (a JSON "\\ud800" escape), which no tokenizer encodes."""
    refused = lone_surrogate(text)
    if refused is not None:
        raise bad_field(
            field,
            f"{where}holds a lone surrogate ({ascii(refused)[1:-1]}), which is not text; fix or drop that \\u escape",
        )


def _capped(ids: list[int], limits: PromptLimits) -> list[int]:
    """`ids`, or a 400 when the prompt is longer than any prompt may be."""
    if len(ids) > limits.max_prompt_len:
        reason = f"is {len(ids)} tokens; this worker takes at most {limits.max_prompt_len}"
        raise APIError(400, f"prompt: {reason}", "prompt", code="context_length_exceeded")
    return ids


def _too_long(field: str, characters: int, limits: PromptLimits) -> None:
    reason = f"{characters} characters cannot fit the {limits.max_prompt_len} tokens a prompt may have"
    raise APIError(400, f"{field}: {reason}", field, code="context_length_exceeded")


def _chat_template(tokenizer: Any) -> Any:
    return getattr(tokenizer, "chat_template", None)
