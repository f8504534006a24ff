"""Tool-call parsers (`hermes`, `llama3_json`) and the `tools` / `tool_choice` check: cases ported from vLLM's tests
(tests/entrypoints/openai/tool_parsers/test_hermes_tool_parser.py, test_llama3_json_tool_parser.py), a streaming
property (every cut of the text streams to the non-streamed parse), and the deltas against the `openai` package's own
types and stream accumulator. No model needed."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from rollout.service.http.tools.tool_calls import (
    TOOL_CALL_PARSERS,
    ParsedToolCalls,
    ToolsError,
    check_tools,
    tool_call_parser,
)
from rollout.validation import FieldError

HERMES = tool_call_parser("hermes")
LLAMA = tool_call_parser("llama3_json")


def hermes_call(name: str, arguments: dict | str) -> str:
    body = arguments if isinstance(arguments, str) else json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>"


def functions(parsed: ParsedToolCalls) -> list[tuple[str, str]]:
    return [(call["function"]["name"], call["function"]["arguments"]) for call in parsed.tool_calls]


def stream(parser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list[dict], bool]:
    """Feed `pieces`; the reassembled content (None when empty), the calls, every delta, and tools_called."""
    feed = parser.start_stream()
    deltas = [delta for piece in pieces for delta in feed.feed(piece)] + feed.finish()
    content, calls = "", {}
    for delta in deltas:
        assert set(delta) <= {"content", "tool_calls"} and len(delta) == 1, delta
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] not in calls:
                assert call["index"] == len(calls), "calls arrive in index order"
                assert call["id"].startswith("call_") and call["type"] == "function"
                calls[call["index"]] = [call["function"]["name"], ""]
            else:
                assert "id" not in call and "name" not in call["function"], "name and id are sent once"
            calls[call["index"]][1] += call["function"]["arguments"]
    assert feed.tools_called == bool(calls)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in feed.tool_calls] == [
        tuple(c) for c in calls.values()
    ]
    return content or None, [tuple(c) for c in calls.values()], deltas, feed.tools_called


# ---- hermes, non-streamed --------------------------------------------------------------------------------------------

# vLLM's test_hermes_tool_parser.py case "lei_test_streaming_01": long Chinese reasoning, then one call.
CHINESE_QUESTION = "5MW燃气轮机设计参数 空气流量 压气机压比 转速 燃烧室出口温度 压气机级数 支点布局"
CHINESE_OUTPUT = (
    "好的，用户现在要研发一个5MW的燃气轮机。\n</think>\n\n<tool_call>\n"
    '{"name": "internet_search", "arguments": {"question": "' + CHINESE_QUESTION + '"}}\n</tool_call>\n\n '
)


def test_hermes_single_call_unicode_kept():
    parsed = HERMES.parse(CHINESE_OUTPUT)
    assert parsed.tools_called
    assert functions(parsed) == [("internet_search", '{"question": "' + CHINESE_QUESTION + '"}')]
    assert parsed.tool_calls[0]["type"] == "function" and parsed.tool_calls[0]["id"].startswith("call_")
    assert parsed.content == "好的，用户现在要研发一个5MW的燃气轮机。\n</think>\n\n"


def test_hermes_only_a_call_has_no_content():
    parsed = HERMES.parse(hermes_call("get_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}))
    assert parsed.content is None
    assert functions(parsed) == [("get_weather", '{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}')]


def test_hermes_whitespace_before_the_call_is_no_content():
    assert HERMES.parse("\n\n " + hermes_call("f", {})).content is None


def test_hermes_parallel_calls_and_text_between_dropped():
    text = "Let me check." + hermes_call("a", {"x": 1}) + "\n" + hermes_call("b", {"y": [1, 2]}) + "\ntrailing"
    parsed = HERMES.parse(text)
    assert parsed.content == "Let me check."
    assert functions(parsed) == [("a", '{"x": 1}'), ("b", '{"y": [1, 2]}')]
    assert len({call["id"] for call in parsed.tool_calls}) == 2


def test_hermes_nested_arguments():
    args = {"filter": {"and": [{"field": "a", "op": "<", "value": 3}, {"not": {"tags": ["x", "y"]}}]}, "limit": None}
    parsed = HERMES.parse(hermes_call("search", args))
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == args


def test_hermes_unclosed_call_at_the_end_is_a_call():
    parsed = HERMES.parse('<tool_call>\n{"name": "f", "arguments": {"q": 1}}')
    assert functions(parsed) == [("f", '{"q": 1}')]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": \'f\', "arguments": {}}\n</tool_call>',  # bad JSON
        'before <tool_call>{"name": "f", "arguments": {}</tool_call>',  # unbalanced
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f"}</tool_call>',  # no arguments (vLLM: KeyError -> content)
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "f", "argu',  # cut off
        "<tool_call>",
        '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>',  # the end tag inside a string
    ],
)
def test_hermes_malformed_call_is_all_content(text):
    parsed = HERMES.parse(text)
    assert parsed.content == text and parsed.tool_calls == [] and not parsed.tools_called


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", "-2e308"])
@pytest.mark.parametrize("parser", [HERMES, LLAMA], ids=["hermes", "llama3_json"])
def test_arguments_json_cannot_hold_make_the_call_content(parser, number):
    """Python's json reads NaN and Infinity (and 1e999 as infinity); JSON has neither, and a client's parser would
    refuse the arguments: such a call is malformed, all content, streamed or not; finite numbers stay calls."""
    call = f'{{"name": "f", "arguments": {{"x": {number}, "y": 1.5}}}}'
    text = hermes_call("f", call) if parser is HERMES else call
    assert parser.parse(text) == ParsedToolCalls(text, [])
    assert stream(parser, [text[:9], text[9:]])[:2] == (text, [])
    fine = text.replace(number, "1e308")
    [(name, arguments)] = functions(parser.parse(fine))
    assert name == "f" and json.loads(arguments, parse_constant=lambda c: pytest.fail(c)) == {"x": 1e308, "y": 1.5}


@pytest.mark.parametrize("text", ["The weather in Dallas is 98F.", "", "  \n", "a < b and <tool> or <tool_cal"])
def test_hermes_no_call_is_content(text):
    assert HERMES.parse(text) == ParsedToolCalls(text, [])


# ---- llama3_json, non-streamed (vLLM's test_llama3_json_tool_parser.py) -----------------------------------------------


def test_llama_simple_parameters():
    parsed = LLAMA.parse('{"name": "getOpenIncidentsTool", "parameters": {}}')
    assert parsed.tools_called and parsed.content is None
    assert functions(parsed) == [("getOpenIncidentsTool", "{}")]


def test_llama_with_arguments_and_arguments_key():
    parsed = LLAMA.parse('{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}')
    assert functions(parsed) == [("searchTool", '{"query": "test query", "limit": 10}')]
    parsed = LLAMA.parse('{"name": "searchTool", "arguments": {"query": "test"}}')
    assert functions(parsed) == [("searchTool", '{"query": "test"}')]


def test_llama_python_tag_and_whitespace():
    parsed = LLAMA.parse(' \n<|python_tag|> {"name": "f", "parameters": {"a": "é"}}\n')
    assert functions(parsed) == [("f", '{"a": "é"}')]


@pytest.mark.parametrize("sep", ["; ", " ; ", ";", ";\n"])
def test_llama_multiple_calls(sep):
    text = sep.join(
        [
            '{"name": "searchTool", "parameters": {"query": "test1"}}',
            '{"name": "getOpenIncidentsTool", "parameters": {}}',
            '{"name": "searchTool", "parameters": {"query": "test2"}}',
        ]
    )
    parsed = LLAMA.parse(text)
    assert functions(parsed) == [
        ("searchTool", '{"query": "test1"}'),
        ("getOpenIncidentsTool", "{}"),
        ("searchTool", '{"query": "test2"}'),
    ]


def test_llama_deeply_nested_and_multiple():
    text = (
        '{"name": "simpleTool", "parameters": {"value": "test"}}; '
        '{"name": "complexTool", "parameters": {"config": {"database": {"connection": {"pool": {"size": 10}}}}}}'
    )
    parsed = LLAMA.parse(text)
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"value": "test"}
    assert json.loads(parsed.tool_calls[1]["function"]["arguments"])["config"]["database"]["connection"]["pool"] == {
        "size": 10
    }


def test_llama_quotes_and_brackets_in_strings():
    text = '{"name": "searchTool", "parameters": {"query": "test {value} [complex]","nested": {"inner": "more {b}"}}}'
    args = json.loads(LLAMA.parse(text).tool_calls[0]["function"]["arguments"])
    assert args == {"query": "test {value} [complex]", "nested": {"inner": "more {b}"}}
    text = '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}'
    assert json.loads(LLAMA.parse(text).tool_calls[0]["function"]["arguments"]) == {"text": 'He said "Hello {world}"'}


def test_llama_text_after_the_calls_is_dropped():
    text = '{"name": "a", "parameters": {}} Would you like to know more?'
    assert LLAMA.parse(text).content is None and functions(LLAMA.parse(text)) == [("a", "{}")]
    assert functions(LLAMA.parse('{"name": "a", "parameters": {}}; and more')) == [("a", "{}")]


@pytest.mark.parametrize(
    "text",
    [
        "This is just some text without any tool calls",
        'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}}',  # vLLM's non-streamed finds this
        '{"name": "invalidTool", "parameters": {invalid json}',
        '{"answer": 42}',
        '{"name": "f", "parameters": [1]}',
        "<|python_tag|>",
        "",
    ],
)
def test_llama_not_a_call_is_content(text):
    assert LLAMA.parse(text) == ParsedToolCalls(text, [])


def test_registry():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json"}
    assert all(parser.name == name for name, parser in TOOL_CALL_PARSERS.items())
    with pytest.raises(ValueError, match="hermes.*llama3_json"):
        tool_call_parser("mistral")


# ---- streaming -------------------------------------------------------------------------------------------------------

HERMES_OUTPUTS = [
    "The weather in Dallas is 98F.",
    "",
    "  \n",
    "a < b and <tool> or <tool_cal",
    "use <toolbox> and <tool_calls> or </tool_call> here",
    CHINESE_OUTPUT,
    hermes_call("get_weather", {"city": "Dallas"}),
    "\n\n" + hermes_call("f", {}) + "\n",
    "Let me check." + hermes_call("a", {"x": 1}) + "\n" + hermes_call("b", {"y": [1, {"z": "<tool_call>"}]}) + " end",
    hermes_call("search", {"filter": {"and": [{"op": "<", "v": 3}]}, "s": 'ünï \\"q\\"'}),
    '<tool_call>\n{"name": "f", "arguments": {"q": 1}}',
    '<tool_call>\n{"name": "f", "argu',
    "<tool_call>",
    'text <tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call> more',
    *(hermes_call("f", f'{{"name": "f", "arguments": {{"x": {number}}}}}') for number in ("NaN", "-Infinity", "1e999")),
    '\n<tool_call>{"name": "f"}</tool_call>\n',
    "<tool_call><tool_call>" + '{"name": "f", "arguments": {}}</tool_call>',
    hermes_call("a", {}) + hermes_call("b", {}) + '<tool_call>{"name": "c", "arguments": {"k": "v"}}',
]

LLAMA_OUTPUTS = [
    "This is just some text without any tool calls",
    "",
    "   ",
    "<|python_tag|>",
    "<|pyth",
    "<|python",
    ' <|python_tag|>{"name": "f", "parameters": {"a": "é"}}',
    '{"name": "getOpenIncidentsTool", "parameters": {}}',
    '{"name": "searchTool", "arguments": {"query": "test {value} [complex]", "n": {"m": "}"}}}',
    '{"name": "a", "parameters": {"q": "t1"}} ; {"name": "b", "parameters": {}};{"name": "c", "parameters": {"x": 1}}',
    '{"name": "a", "parameters": {}} Would you like to know more?',
    '{"name": "a", "parameters": {"x": Infinity}}',
    '{"name": "a", "parameters": {}};  ',
    '{"name": "a", "parameters": {}}; and more {"name": "b", "parameters": {}}',
    'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}}',
    '{"name": "invalidTool", "parameters": {invalid json}',
    '{"name": "f", "parameters": {"x": "unterminated',
    '{"answer": 42}',
    '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
]

# A malformed call after good ones: the one case a stream cannot match (see tool_call_stream's docstring).
DIVERGENT = [
    (HERMES, "Sure." + hermes_call("a", {}) + '<tool_call>{"name": bad}</tool_call> after', '<tool_call>{"name": bad}'),
    (LLAMA, '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {bad}}', '{"name": "b"'),
    (LLAMA, '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1e400]}}', '{"name": "b"'),
    (
        HERMES,
        "Sure." + hermes_call("a", {}) + '<tool_call>{"name": "b", "arguments": {"x": NaN}}',
        '<tool_call>{"name": "b"',
    ),
]


def cuts(text: str, rng: random.Random) -> list[list[str]]:
    """Every 2-way split, every character alone, and random small pieces (empty ones too)."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(20):
        pieces, i = [], 0
        while i < len(text):
            size = rng.choice([0, 1, 1, 2, 3, 5, 8])
            pieces.append(text[i : i + size])
            i += size
        out.append(pieces)
    return out


def expected(parser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    parsed = parser.parse(text)
    return parsed.content or None, functions(parsed)


@pytest.mark.parametrize(
    "parser, text",
    [(HERMES, t) for t in HERMES_OUTPUTS] + [(LLAMA, t) for t in LLAMA_OUTPUTS],
    ids=lambda value: repr(value) if isinstance(value, str) else type(value).__name__,  # the same in every process
)
def test_stream_equals_non_streamed_however_cut(parser, text):
    rng = random.Random(len(text))
    want = expected(parser, text)
    for pieces in cuts(text, rng):
        content, calls, _, tools_called = stream(parser, pieces)
        assert (content, calls) == want, pieces
        assert tools_called == parser.parse(text).tools_called


@pytest.mark.parametrize("parser, text, bad", DIVERGENT)
def test_malformed_call_after_sent_calls(parser, text, bad):
    assert parser.parse(text) == ParsedToolCalls(text, [])  # as vLLM: all content
    for pieces in cuts(text, random.Random(0)):
        content, calls, _, tools_called = stream(parser, pieces)
        assert tools_called and calls == [("a", "{}")]
        assert bad in content and text.endswith(content.split(bad)[1]) and "Sure." not in content.split(bad)[1]


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "_call>", "</", "<|python_tag|>", "<|py", "{", "}", ";", " ", "\n"]
FRAGMENTS += ['"name"', '"arguments"', '"parameters"', ":", ",", '"f"', '"x"', "{}", "1", "é", "text", "<", ">"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=30), st.randoms(use_true_random=False), st.booleans())
def test_stream_split_invariant_on_arbitrary_text(fragments, rng, use_llama):
    parser = LLAMA if use_llama else HERMES
    text = "".join(fragments)
    whole = stream(parser, [text])[:2]
    for pieces in cuts(text, rng)[-5:] + [list(text)]:
        assert stream(parser, pieces)[:2] == whole
    if not (whole[1] and not parser.parse(text).tool_calls):  # outside the divergent case
        assert whole == expected(parser, text)


def test_partial_tag_held_back_never_sent_as_content():
    feed = HERMES.start_stream()
    assert feed.feed("Hello <tool") == [{"content": "Hello "}]
    assert feed.feed("_call>\n{") == []
    deltas = feed.feed('"name": "f", "arguments": {}}\n</tool_call>')
    assert [d["tool_calls"][0]["function"] for d in deltas] == [{"name": "f", "arguments": ""}, {"arguments": "{}"}]
    assert feed.finish() == [] and feed.tools_called
    feed = HERMES.start_stream()
    assert feed.feed("a <tool") == [{"content": "a "}]
    assert feed.feed("box>") == [{"content": "<toolbox>"}]
    assert feed.finish() == [] and not feed.tools_called
    with pytest.raises(RuntimeError):
        feed.feed("x")


def test_llama_stream_decides_after_the_tag_and_sends_each_call_when_whole():
    feed = LLAMA.start_stream()
    assert feed.feed("<|pyth") == [] and feed.feed("on_tag|> ") == []
    assert feed.feed('{"name": "a", "parameters": {"x": 1}') == []
    first = feed.feed("}; ")
    assert [d["tool_calls"][0]["function"] for d in first] == [
        {"name": "a", "arguments": ""},
        {"arguments": '{"x": 1}'},
    ]
    assert feed.feed('{"name": "b", "parameters": {}}') != [] and feed.finish() == []
    feed = LLAMA.start_stream()
    assert feed.feed("  ") == [] and feed.feed("Hi") == [{"content": "  Hi"}] and feed.feed(" {") == [{"content": " {"}]


# ---- against the openai package ----------------------------------------------------------------------------------


def chunk(delta: dict, finish_reason: str | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
    )


@pytest.mark.parametrize(
    "parser, text",
    [(HERMES, HERMES_OUTPUTS[8]), (HERMES, CHINESE_OUTPUT), (HERMES, "plain"), (LLAMA, LLAMA_OUTPUTS[9])],
)
def test_openai_types_and_stream_accumulator(parser, text):
    parsed = parser.parse(text)
    finish = "tool_calls" if parsed.tools_called else "stop"
    message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls or None}
    completion = ChatCompletion.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        }
    )
    assert completion.choices[0].message.model_dump(exclude_none=True, exclude={"role"}) == {
        key: value for key, value in message.items() if value is not None and key != "role"
    }

    rng = random.Random(1)
    pieces = cuts(text, rng)[-1]
    _, _, deltas, tools_called = stream(parser, pieces)
    state = ChatCompletionStreamState()
    state.handle_chunk(chunk({"role": "assistant", "content": ""}))
    for delta in deltas:
        state.handle_chunk(chunk(delta))
    state.handle_chunk(chunk({}, "tool_calls" if tools_called else "stop"))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == finish
    assert (final.message.content or None) == parsed.content
    got = [(call.function.name, call.function.arguments) for call in final.message.tool_calls or []]
    assert got == functions(parsed)
    assert all(call.id.startswith("call_") and call.type == "function" for call in final.message.tool_calls or [])


# ---- tools / tool_choice ---------------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
    },
}
BARE = {"type": "function", "function": {"name": "now-2_x"}}


def test_check_tools_accepts():
    spec = check_tools([WEATHER, BARE], None)
    assert (spec.tools, spec.tool_choice, spec.function, spec.parse_tool_calls, spec.constrained) == (
        [WEATHER, BARE],
        "auto",
        None,
        True,
        False,
    )
    assert check_tools(None, None).tool_choice == "none" and not check_tools(None, None).parse_tool_calls
    assert check_tools(None, "none").tools == []
    none = check_tools([WEATHER], "none")
    assert not none.parse_tool_calls and none.tools == [WEATHER]  # rendered, not parsed: the text is content
    assert check_tools([WEATHER], "required").constrained
    named = check_tools([WEATHER, BARE], {"type": "function", "function": {"name": "now-2_x"}})
    assert (named.tool_choice, named.function, named.parse_tool_calls, named.constrained) == (
        "function",
        "now-2_x",
        True,
        True,
    )
    assert check_tools([], "required").tool_choice == "none"  # vLLM: "required" with no tools is "none"
    assert check_tools([{"type": "function", "function": {"name": "f", "description": None}}], "auto").tools


@pytest.mark.parametrize(
    "tools, tool_choice, field",
    [
        ({"type": "function"}, None, "tools"),
        (["get_weather"], None, "tools[0]"),
        ([WEATHER, {"type": "custom", "function": {"name": "f"}}], None, "tools[1].type"),
        ([{"function": {"name": "f"}}], None, "tools[0].type"),
        ([{"type": "function", "function": {"name": "f"}, "extra": 1}], None, "tools[0].extra"),
        ([{"type": "function"}], None, "tools[0].function"),
        ([{"type": "function", "function": "f"}], None, "tools[0].function"),
        ([{"type": "function", "function": {"name": "f", "examples": []}}], None, "tools[0].function.examples"),
        ([{"type": "function", "function": {}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "get weather"}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f\n"}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "é"}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}], None, "tools[0].function.description"),
        ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, "tools[0].function.strict"),
        ([WEATHER], "any", "tool_choice"),
        ([WEATHER], 1, "tool_choice"),
        ([WEATHER], {"type": "tool", "function": {"name": "get_weather"}}, "tool_choice.type"),
        ([WEATHER], {"type": "function", "name": "get_weather"}, "tool_choice.name"),
        ([WEATHER], {"type": "function"}, "tool_choice.function"),
        ([WEATHER], {"type": "function", "function": {"name": "get_weather", "x": 1}}, "tool_choice.function.x"),
        ([WEATHER], {"type": "function", "function": {"name": "other"}}, "tool_choice.function.name"),
        ([], {"type": "function", "function": {"name": "get_weather"}}, "tool_choice.function.name"),
        (None, "auto", "tool_choice"),
        (None, "required", "tool_choice"),
    ],
)
def test_check_tools_refusals_name_the_field(tools, tool_choice, field):
    with pytest.raises(ToolsError) as caught:
        check_tools(tools, tool_choice)
    assert caught.value.field == field and caught.value.reason
    assert isinstance(caught.value, FieldError) and isinstance(caught.value, ValueError)
    assert str(caught.value).startswith(f"{field}: ")
