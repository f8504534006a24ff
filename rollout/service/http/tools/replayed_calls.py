"""An assistant message's `tool_calls` replayed in a chat request's history, as chat templates expect them: each
call's `function.arguments` a mapping, not the JSON string OpenAI's API carries (transformers' chat-template docs;
vLLM parses them the same way before rendering). Passed on as strings, a template that writes `arguments | tojson`
(Llama 3.1's) renders the history double-encoded, and one that walks `arguments | items` (Qwen3-Coder's) fails."""

from __future__ import annotations

import json
from typing import Any

from rollout.validation import lone_surrogate


class ReplayedCallError(ValueError):
    """A replayed tool call that no template could render as the model wrote it; the message says which and why."""


def template_tool_calls(tool_calls: Any) -> list[dict[str, Any]] | None:
    """An assistant message's `tool_calls` with each call's arguments parsed into a mapping, on a copy (the request's
    body stays as it came). An empty list gives None: the message then goes to the template without `tool_calls`,
    on its plain assistant path, as vLLM does.

    Args:
        tool_calls: the message's `tool_calls` field, as the client sent it.
    Raises:
        ReplayedCallError: not a list of function calls, a call without a string name, or arguments that are not a
            JSON object (a string that does not parse, or parses to something else: vLLM renders those as `{}`,
            which would silently change the history the model is shown).
    """
    if not isinstance(tool_calls, list):
        raise ReplayedCallError(f"tool_calls must be a list, got {type(tool_calls).__name__}")
    if not tool_calls:
        return None
    return [_call(position, call) for position, call in enumerate(tool_calls)]


def _call(position: int, call: Any) -> dict[str, Any]:
    where = f"tool_calls[{position}]"
    if not isinstance(call, dict):
        raise ReplayedCallError(f"{where} must be an object")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise ReplayedCallError(f'{where} must be of type "function", with a "function" object')
    if not isinstance(function.get("name"), str):
        raise ReplayedCallError(f"{where}.function.name must be a string")
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        parsed: Any = {}
    elif isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise ReplayedCallError(f"{where}.function.arguments is not valid JSON ({error})") from None
        except RecursionError:  # (the body's own nesting is bounded before it is parsed; a string's is not)
            raise ReplayedCallError(f"{where}.function.arguments is JSON nested too deeply to read") from None
    else:
        parsed = arguments
    if not isinstance(parsed, dict):
        raise ReplayedCallError(
            f"{where}.function.arguments must be a JSON object (or a string holding one), got {type(parsed).__name__}"
        )
    # A JSON "\ud800" escape makes a lone surrogate, which no tokenizer encodes (it failed inside the template).
    if lone_surrogate(json.dumps(parsed, ensure_ascii=False)) is not None:
        raise ReplayedCallError(f"{where}.function.arguments holds a lone surrogate, which is not text")
    return {**call, "function": {**function, "arguments": parsed}}
