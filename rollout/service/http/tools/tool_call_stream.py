"""The streaming half of the tool-call parsers (`tool_calls.py`): a model's text, fed piece by piece as it is
generated, turned into the `delta` dicts of OpenAI chat-completion chunks.

Each tool call's text is held back until it is whole (its closing tag, the end of its JSON object, or the end of the
text), then sent as two deltas: `{"tool_calls": [{"index", "id", "type": "function", "function": {"name",
"arguments": ""}}]}` and `{"tool_calls": [{"index", "function": {"arguments": <the whole JSON string>}}]}`. Text that
might still turn out to be a tag (`"<tool"` at the end of a piece) is held back too, never sent as content first.

Contract (tests/test_tool_calls.py): however the text is cut into pieces, the content a stream sends adds up to its
parser's non-streamed `content` (both None/empty alike), and each call's `arguments` pieces add up to the non-streamed
`arguments`. One case a stream cannot take back: a malformed call after calls already sent. Non-streamed, the whole
text is then content with no calls (as vLLM); streamed, the calls sent stay and the text from the bad call on is sent
as content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

Delta = dict[str, Any]
Function = tuple[str, str]  # (name, arguments as a JSON string)

_WS = re.compile(r"\s*")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Arguments must be JSON a client's parser reads: Python's own reads NaN, Infinity and -Infinity, JSON has none.
STRICT_JSON = json.JSONDecoder(parse_constant=_refuse_constant)
_DECODER = STRICT_JSON
_TEXT, _CALL, _AFTER, _PLAIN, _START, _JSON, _DONE = range(7)


def new_call_id() -> str:
    """A fresh tool-call id: "call_" and 24 hex digits, OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A tool call in a message's `tool_calls` form (`arguments`: a JSON string)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def ws_end(text: str, pos: int) -> int:
    """The index of the first non-whitespace character of `text` at or after `pos` (len(text): none)."""
    return _WS.match(text, pos).end()


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag` (0: none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ToolCallStream:
    """One choice's text, fed piece by piece; subclasses read a format.

    Attributes:
        tool_calls: the calls sent so far, in message form (`tool_call`); `tools_called` is whether there are any
            (the endpoint then reports finish_reason "tool_calls" where the model stopped by itself).
    """

    def __init__(self) -> None:
        self.tool_calls: list[dict[str, Any]] = []
        self._out: list[Delta] = []
        self._finished = False

    @property
    def tools_called(self) -> bool:
        """Whether any tool call was sent."""
        return bool(self.tool_calls)

    def feed(self, delta_text: str) -> list[Delta]:
        """The deltas to send for the next piece of generated text (often none: text held back).

        Args:
            delta_text: the text generated since the last call.
        """
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._take(delta_text, final=False)
        return self._flush()

    def finish(self) -> list[Delta]:
        """The deltas for whatever was held back, once the text is complete; call it once, at the end."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._take("", final=True)
        self._finished = True
        return self._flush()

    def _take(self, text: str, final: bool) -> None:
        raise NotImplementedError

    def _flush(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._out and "content" in self._out[-1]:
            self._out[-1]["content"] += text
        else:
            self._out.append({"content": text})

    def _call(self, function: Function) -> None:
        name, arguments = function
        index, call_id = len(self.tool_calls), new_call_id()
        self.tool_calls.append(tool_call(call_id, name, arguments))
        first = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        self._out.append({"tool_calls": [first]})
        self._out.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})


class TaggedCallStream(ToolCallStream):
    """Calls written as `<start> JSON <end>` blocks after optional content (hermes).

    Content is the text before the first block (held back while it is only whitespace: content None then, as
    non-streamed); text between and after blocks is dropped, as non-streamed; a block left open at the end is a call.
    """

    def __init__(self, decode: Callable[[str], Function | None], start: str, end: str) -> None:
        """Args:
        decode: a block's text -> (name, arguments JSON), or None when malformed.
        start, end: the tags around a call.
        """
        super().__init__()
        self._decode, self._start, self._end = decode, start, end
        self._mode = _TEXT
        self._pending = ""  # text not yet decided
        self._lead = ""  # whitespace-only content, held until something else comes
        self._sent_text = False
        self._scan = 0  # where to look for the end tag in _pending

    def _take(self, text: str, final: bool) -> None:
        self._pending += text
        while True:
            if self._mode == _PLAIN:
                self._content(self._pending)
                self._pending = ""
                return
            if self._mode == _CALL:
                at = self._pending.find(self._end, self._scan)
                if at < 0 and not final:
                    self._scan = max(0, len(self._pending) - len(self._end) + 1)
                    return
                if at < 0:
                    block, self._pending = self._pending, ""
                    self._close(block, closed=False)
                    continue
                block, self._pending = self._pending[:at], self._pending[at + len(self._end) :]
                self._scan = 0
                self._close(block, closed=True)
                continue
            at = self._pending.find(self._start)
            if at >= 0:
                before, self._pending = self._pending[:at], self._pending[at + len(self._start) :]
                if self._mode == _TEXT:
                    self._text(before, final=False)
                self._mode = _CALL
                continue
            keep = 0 if final else partial_suffix(self._pending, self._start)
            ready, self._pending = (
                self._pending[: len(self._pending) - keep],
                self._pending[len(self._pending) - keep :],
            )
            if self._mode == _TEXT:
                self._text(ready, final)
            return

    def _text(self, text: str, final: bool) -> None:
        if not self._sent_text and not text.strip() and not final:
            self._lead += text
            return
        self._content(self._lead + text)
        self._lead = ""
        self._sent_text = True

    def _close(self, block: str, closed: bool) -> None:
        function = self._decode(block)
        if function is not None:
            self._lead = ""  # whitespace before the first call is no content
            self._call(function)
            self._mode = _AFTER
            return
        raw = self._start + block + (self._end if closed else "")
        if not self.tool_calls:  # nothing sent yet: the whole text is content, as non-streamed
            raw, self._lead = self._lead + raw, ""
        self._content(raw)
        self._mode = _PLAIN


class JsonCallsStream(ToolCallStream):
    """Calls written as JSON objects separated by `;`, the whole text being calls when it starts with `{` after an
    optional tag (llama3_json); else it is all content. Text after the last object is dropped, as non-streamed."""

    def __init__(self, decode: Callable[[Any], Function | None], tag: str) -> None:
        """Args:
        decode: a decoded JSON value -> (name, arguments JSON), or None when it is no call.
        tag: the optional tag before the calls ("<|python_tag|>").
        """
        super().__init__()
        self._decode, self._tag = decode, tag
        self._mode = _START
        self._all = ""  # the text so far (while deciding, and in JSON mode)
        self._pos = 0  # where the next object or separator starts in _all
        self._expect_sep = False
        self._ready = True  # a "}" came since the last failed decode: an object may be whole

    def _take(self, text: str, final: bool) -> None:
        if self._mode == _PLAIN:
            self._content(text)
            return
        if self._mode == _DONE:
            return
        self._all += text
        self._ready = self._ready or "}" in text or final
        if self._mode == _START:
            body = self._all.lstrip()
            maybe_tag = self._tag.startswith(body) and body != self._tag
            if body.startswith(self._tag):
                body = body[len(self._tag) :].lstrip()
            if (not body or maybe_tag) and not final:
                return
            if not body.startswith("{"):
                self._mode = _PLAIN
                self._content(self._all)
                return
            self._mode, self._pos = _JSON, len(self._all) - len(body)
        self._scan(final)

    def _scan(self, final: bool) -> None:
        while True:
            at = ws_end(self._all, self._pos)
            if at == len(self._all):
                return
            if self._expect_sep:
                if self._all[at] != ";":
                    self._mode = _DONE
                    return
                self._pos, self._expect_sep = at + 1, False
                continue
            if self._all[at] != "{":
                self._mode = _DONE
                return
            if not self._ready:
                return
            try:
                value, end = _DECODER.raw_decode(self._all, at)
            except (ValueError, RecursionError):
                self._ready = False
                if final:
                    self._bad(at)
                return
            function = self._decode(value)
            if function is None:
                self._bad(at)
                return
            self._call(function)
            self._pos, self._expect_sep = end, True

    def _bad(self, at: int) -> None:
        # nothing sent yet: the whole text is content, as non-streamed; else the text from the bad object on
        self._content(self._all[at:] if self.tool_calls else self._all)
        self._mode = _PLAIN
