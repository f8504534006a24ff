"""Tool calls in a chat answer: the worker's `--tool-call-parser` reads each choice's text into OpenAI's
`message.tool_calls` (or, streamed, `delta.tool_calls`), and the finish reason becomes "tool_calls" when the model
called tools and stopped by itself, as vLLM answers. With `parallel_tool_calls: false` only each choice's first call
comes back (whole and streamed), as vLLM filters them.

Which requests get a parser: those with `tools` and a `tool_choice` other than "none". Without a parser such a request
is refused (400 naming --tool-call-parser), never answered with the tools silently dropped; "required" and a named
function (vLLM forces them with a grammar) are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout.service.http.errors import APIError
from rollout.service.http.tools.tool_call_stream import ToolCallStream
from rollout.service.http.tools.tool_calls import TOOL_CALL_PARSERS, ToolCallParser, ToolSpec


def tool_calling(spec: ToolSpec, parser_name: str | None, parallel: bool = True) -> ToolCalling | None:
    """How a chat request's answer reads tool calls (None: its text is all content).

    Args:
        spec: the request's checked tools and tool_choice.
        parser_name: the worker's --tool-call-parser (None: none).
        parallel: the request's `parallel_tool_calls` (False: only each choice's first call is answered).

    Raises:
        APIError: tools asked for without a parser, or a tool_choice that needs constrained decoding.
    """
    if not spec.parse_tool_calls:
        return None
    if spec.constrained:
        reason = (
            f"{spec.tool_choice!r} (tool calls forced by a grammar) is not supported; use 'auto' or 'none', or "
            "constrain the text with response_format / structured_outputs"
        )
        raise APIError(400, f"tool_choice: {reason}", "tool_choice")
    if parser_name is None:
        reason = (
            "tool calls need the worker's --tool-call-parser (one of "
            f"{', '.join(sorted(TOOL_CALL_PARSERS))}); or send tool_choice='none' to render the tools only"
        )
        raise APIError(400, f"tools: {reason}", "tools")
    return ToolCalling(TOOL_CALL_PARSERS[parser_name], parallel)


@dataclass
class ToolCalling:
    """One chat answer's tool-call reading: a stream per streamed choice (`parallel` False: the first call only)."""

    parser: ToolCallParser
    parallel: bool = True
    streams: dict[int, ToolCallStream] = field(default_factory=dict)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's message and finish reason.

        Args:
            text: the choice's text.
            finish_reason: the engine's finish reason.
        """
        parsed = self.parser.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tools_called:
            message["tool_calls"] = parsed.tool_calls if self.parallel else parsed.tool_calls[:1]
        return message, _finish_reason(parsed.tools_called, finish_reason)

    def deltas(self, index: int, text: str, finished: bool) -> list[dict[str, Any]]:
        """The `delta` objects a streamed choice's new text makes (text that may begin a tool call is held back
        until it is decided; the last ones come with `finished`).

        Args:
            index: the choice's index.
            text: its new text.
            finished: it ended with this text.
        """
        stream = self.streams.get(index)
        if stream is None:
            stream = self.streams[index] = self.parser.start_stream()
        deltas = stream.feed(text) if text else []
        deltas = deltas + stream.finish() if finished else deltas
        if self.parallel:
            return deltas
        # As vLLM: a later call's deltas are left out (a stream's calls are numbered from 0 by `index`).
        kept = []
        for delta in deltas:
            if "tool_calls" in delta:
                first = [call for call in delta["tool_calls"] if call["index"] == 0]
                delta = {key: value for key, value in delta.items() if key != "tool_calls"}
                if first:
                    delta["tool_calls"] = first
                if not delta:
                    continue
            kept.append(delta)
        return kept

    def finish_reason(self, index: int, finish_reason: str | None) -> str | None:
        """A streamed choice's finish reason, once its last deltas were made."""
        stream = self.streams.get(index)
        return _finish_reason(stream is not None and stream.tools_called, finish_reason)


def _finish_reason(tools_called: bool, finish_reason: str | None) -> str | None:
    return "tool_calls" if tools_called and finish_reason == "stop" else finish_reason
