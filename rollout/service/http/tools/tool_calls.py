"""Tool calls in a chat model's text, as vLLM's `--tool-call-parser hermes` and `llama3_json`, and the `tools` /
`tool_choice` fields of a chat request.

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, once or more,
  possibly after content. Content is the text before the first `<tool_call>` (None when only whitespace); text between
  and after the blocks is dropped; a block left open at the end of the text is still a call.
- `llama3_json` (Llama 3.1/3.2): the text, after an optional `<|python_tag|>`, is `{"name": ..., "parameters": {...}}`
  (or "arguments"), or several such objects separated by `;`; content is then None. Text that does not start with
  `{` is all content (vLLM's streaming rule; its non-streamed parser also finds JSON after leading text); text after
  the last object is dropped.

Either way a malformed call (bad JSON, no string "name", arguments not a JSON object) makes the whole text content with
no tool calls, as vLLM, and nothing raises. Arguments are re-serialised with `json.dumps(..., ensure_ascii=False)`,
and are strict JSON: a call holding NaN, Infinity or -Infinity (which Python's json reads), or a number past a
float's range (1e999, read as infinity), is malformed too, so a client's `json.loads` of its arguments never fails.
Streaming is in `tool_call_stream.py`. Reasoning text (`<think>`) is expected to be split off before these parsers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout.service.http.tools.tool_call_stream import (
    STRICT_JSON,
    Function,
    JsonCallsStream,
    TaggedCallStream,
    ToolCallStream,
    new_call_id,
    tool_call,
    ws_end,
)
from rollout.validation import FieldError

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_DECODER = STRICT_JSON


@dataclass
class ParsedToolCalls:
    """A whole answer's text, parsed.

    Attributes:
        content: the message's content (None: none).
        tool_calls: the calls in message form: {"id", "type": "function", "function": {"name", "arguments"}}.
    """

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        """Whether the model called tools (finish_reason "tool_calls" where it stopped by itself)."""
        return bool(self.tool_calls)


class ToolCallParser(Protocol):
    """One tool-call format (stateless; each streamed choice gets its own `ToolCallStream`)."""

    name: str

    def parse(self, text: str) -> ParsedToolCalls:
        """The content and tool calls of a whole answer.

        Args:
            text: the generated text (special tokens skipped, reasoning already split off).
        """
        ...

    def start_stream(self) -> ToolCallStream:
        """A fresh stream for one choice: `feed(delta_text)` per piece, then `finish()`."""
        ...


def _function(value: Any, argument_keys: tuple[str, ...]) -> Function | None:
    """(name, arguments JSON) of a decoded call object, or None when it is no valid call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((key for key in argument_keys if key in value), None)
    if key is None or not isinstance(value[key], dict):
        return None
    try:
        return value["name"], json.dumps(value[key], ensure_ascii=False, allow_nan=False)
    except ValueError:  # a number past a float's range was read as infinity: JSON cannot hold it
        return None


def _hermes_block(block: str) -> Function | None:
    try:
        value = STRICT_JSON.decode(block)
    except (ValueError, RecursionError):  # bad JSON (NaN and Infinity included); absurdly deep nesting
        return None
    return _function(value, ("arguments",))


def _llama_object(value: Any) -> Function | None:
    return _function(value, ("arguments", "parameters"))


class HermesParser:
    """`--tool-call-parser hermes`: `<tool_call>{"name", "arguments"}</tool_call>` blocks."""

    name = "hermes"

    def parse(self, text: str) -> ParsedToolCalls:
        """The content and tool calls of a whole answer (see the module's docstring).

        Args:
            text: the generated text.
        """
        start = text.find(HERMES_START)
        if start < 0:
            return ParsedToolCalls(text)
        calls = []
        for closed, open_ in _HERMES_BLOCK.findall(text):
            function = _hermes_block(closed or open_)
            if function is None:
                return ParsedToolCalls(text)
            calls.append(tool_call(new_call_id(), *function))
        content = text[:start]
        return ParsedToolCalls(content if content.strip() else None, calls)

    def start_stream(self) -> ToolCallStream:
        """A fresh stream for one choice."""
        return TaggedCallStream(_hermes_block, HERMES_START, HERMES_END)


class Llama3JsonParser:
    """`--tool-call-parser llama3_json`: `[<|python_tag|>]{"name", "parameters"}; {...}`."""

    name = "llama3_json"

    def parse(self, text: str) -> ParsedToolCalls:
        """The content and tool calls of a whole answer (see the module's docstring).

        Args:
            text: the generated text.
        """
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return ParsedToolCalls(text)
        pos, calls = len(text) - len(body), []
        while True:
            try:
                value, end = _DECODER.raw_decode(text, pos)
            except (ValueError, RecursionError):
                return ParsedToolCalls(text)
            function = _llama_object(value)
            if function is None:
                return ParsedToolCalls(text)
            calls.append(tool_call(new_call_id(), *function))
            pos = ws_end(text, end)
            if pos == len(text) or text[pos] != ";":
                break
            pos = ws_end(text, pos + 1)
            if pos == len(text) or text[pos] != "{":
                break
        return ParsedToolCalls(None, calls)

    def start_stream(self) -> ToolCallStream:
        """A fresh stream for one choice."""
        return JsonCallsStream(_llama_object, PYTHON_TAG)


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser called `name` (`--tool-call-parser`).

    Args:
        name: one of TOOL_CALL_PARSERS.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_CALL_PARSERS)}") from None


# ---- the request's `tools` and `tool_choice` ----------------------------------------------------------------------

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class ToolsError(FieldError):
    """A bad `tools` or `tool_choice`, naming the field (e.g. "tools[0].function.name"): the endpoint's 400."""


@dataclass(frozen=True)
class ToolSpec:
    """A request's checked tools.

    Attributes:
        tools: the tools as given ([] when none), to render into the prompt.
        tool_choice: "none", "auto", "required", or "function": the one function named by `function`.
        function: the function a named tool_choice asks for (None: not named).
        parse_tool_calls: whether to parse tool calls out of the text: tools given and tool_choice not "none" (with
            "none" the text is all content, as vLLM).
        constrained: tool_choice is "required" or a named function. vLLM enforces these with guided decoding; these
            parsers do not (they read the text as with "auto"), so an endpoint without constrained decoding may
            refuse them.
    """

    tools: list[dict[str, Any]]
    tool_choice: str
    function: str | None
    parse_tool_calls: bool
    constrained: bool


def _check_keys(value: dict[str, Any], known: set[str], where: str) -> None:
    for key in value:
        if key not in known:
            raise ToolsError(f"{where}.{key}", f"unknown field (known: {sorted(known)})")


def _check_tool(index: int, tool: Any) -> str:
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise ToolsError(where, "must be an object {'type': 'function', 'function': {...}}")
    _check_keys(tool, _TOOL_KEYS, where)
    if tool.get("type") != "function":
        raise ToolsError(f"{where}.type", f"must be 'function', got {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolsError(f"{where}.function", "must be an object with a name")
    _check_keys(function, _FUNCTION_KEYS, f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolsError(f"{where}.function.name", f"must be 1-64 characters of a-z, A-Z, 0-9, _ and -, got {name!r}")
    for key, kind, label in (("description", str, "a string"), ("parameters", dict, "a JSON Schema object")):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise ToolsError(f"{where}.function.{key}", f"must be {label}")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise ToolsError(f"{where}.function.strict", "must be a boolean")
    return name


def check_tools(tools: Any, tool_choice: Any) -> ToolSpec:
    """Check a chat request's `tools` and `tool_choice` (OpenAI's shapes; "strict" is accepted and has no effect).

    Args:
        tools: None, or a list of {"type": "function", "function": {"name", "description"?, "parameters"?,
            "strict"?}}; [] counts as none.
        tool_choice: None (then "auto" with tools, "none" without), "none", "auto", "required", or
            {"type": "function", "function": {"name": <one of the tools>}}.

    Raises:
        ToolsError: naming the field at fault.
    """
    if tools is not None and not isinstance(tools, list):
        raise ToolsError("tools", "must be a list of tool objects")
    names = [_check_tool(index, tool) for index, tool in enumerate(tools or [])]
    function_name = None
    if tool_choice is None:
        choice = "auto" if names else "none"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolsError("tool_choice", f"must be 'none', 'auto', 'required' or a function, got {tool_choice!r}")
        choice = tool_choice
    elif isinstance(tool_choice, dict):
        _check_keys(tool_choice, _TOOL_KEYS, "tool_choice")
        if tool_choice.get("type") != "function":
            raise ToolsError("tool_choice.type", f"must be 'function', got {tool_choice.get('type')!r}")
        function = tool_choice.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolsError("tool_choice.function", "must be an object with a name")
        _check_keys(function, {"name"}, "tool_choice.function")
        if function["name"] not in names:
            raise ToolsError("tool_choice.function.name", f"{function['name']!r} is not one of the tools' functions")
        choice, function_name = "function", function["name"]
    else:
        raise ToolsError("tool_choice", "must be a string or an object")
    if tools is None and choice != "none":
        raise ToolsError("tool_choice", f"{choice!r} needs tools")
    if not names:
        choice = "none"  # tools=[]: "auto" and "required" ask for nothing (vLLM's "required" with no tools)
    return ToolSpec(list(tools or []), choice, function_name, choice != "none", choice not in ("none", "auto"))
