"""A chat request's history as the chat template sees it (`chat_prompt`): an assistant's replayed `tool_calls` carry
OpenAI's JSON-string arguments, which the template gets as mappings, and text content parts join with newlines, both
as vLLM hands them over. The reference is transformers' own `apply_chat_template` given the same conversation in the
form its docs ask for (arguments as dicts, content as one string), with templates written as real models' are:
Llama 3.1's `arguments | tojson` and Qwen3-Coder's `arguments | items`."""

from __future__ import annotations

import copy
import json

import pytest

from rollout.presets import tiny_tokenizer
from rollout.service.http.api.prompts import PromptLimits, chat_prompt
from rollout.service.http.errors import APIError

# Llama 3.1's rendering of an assistant's tool call (its JSON form), in a ChatML frame.
TOJSON_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    '{{- \'<|im_start|>assistant\\n{"name": "\' + tool_call.name + \'", "parameters": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3-Coder's: each argument a <parameter> of its own.
ITEMS_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined %}{{- '<|im_start|>assistant\\n' }}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- for args_name, args_value in tool_call.arguments|items %}"
    "{{- '<parameter=' + args_name + '>\\n' + (args_value | string) + '\\n</parameter>\\n' }}{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LIMITS = PromptLimits(max_prompt_len=4096)
ARGUMENTS = {"text": "abc", "times": 2}


def tokenizer_with(template: str):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


def conversation(arguments, content=None) -> list[dict]:
    call = {"id": "call_0", "type": "function", "function": {"name": "count_letters", "arguments": arguments}}
    return [
        {"role": "user", "content": "count the letters of abc"},
        {"role": "assistant", "content": content, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"letters": 3}'},
    ]


def reference(tokenizer, messages: list[dict]) -> list[int]:
    """What transformers makes of the conversation as its docs write it."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


@pytest.mark.parametrize("template", [TOJSON_TEMPLATE, ITEMS_TEMPLATE], ids=["tojson", "items"])
def test_replayed_tool_call_arguments_reach_the_template_as_a_mapping(template):
    tokenizer = tokenizer_with(template)
    body = {"messages": conversation(json.dumps(ARGUMENTS))}
    sent = copy.deepcopy(body)
    ids = chat_prompt(body, tokenizer, LIMITS)
    assert ids == reference(tokenizer, conversation(ARGUMENTS))
    assert body == sent  # the request's own body is left as it came
    text = tokenizer.decode(ids)
    if template is TOJSON_TEMPLATE:
        assert '"parameters": {"text": "abc", "times": 2}' in text, text  # not a JSON string inside the JSON
    else:
        assert "<parameter=text>\nabc\n</parameter>" in text, text


@pytest.mark.parametrize("arguments", [None, "", {}], ids=["none", "empty-string", "object"])
def test_missing_arguments_render_as_an_empty_object(arguments):
    tokenizer = tokenizer_with(TOJSON_TEMPLATE)
    ids = chat_prompt({"messages": conversation(arguments)}, tokenizer, LIMITS)
    assert ids == reference(tokenizer, conversation({}))


def test_an_empty_tool_calls_list_takes_the_plain_assistant_path():
    tokenizer = tokenizer_with(TOJSON_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "tool_calls": []}]
    ids = chat_prompt({"messages": messages}, tokenizer, LIMITS)
    assert ids == reference(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])


@pytest.mark.parametrize(
    ("tool_calls", "reason"),
    [
        ("call", "tool_calls must be a list"),
        (["call"], "tool_calls[0] must be an object"),
        ([{"type": "code", "function": {"name": "f"}}], 'tool_calls[0] must be of type "function"'),
        ([{"type": "function", "function": {"arguments": "{}"}}], "tool_calls[0].function.name must be a string"),
        ([{"function": {"name": "f", "arguments": "{'a': 1}"}}], "tool_calls[0].function.arguments is not valid JSON"),
        ([{"function": {"name": "f", "arguments": "[1, 2]"}}], "must be a JSON object (or a string holding one)"),
        ([{"function": {"name": "f", "arguments": 42}}], "must be a JSON object (or a string holding one), got int"),
        ([{"function": {"name": "f", "arguments": "[" * 100_000}}], "arguments is JSON nested too deeply to read"),
        ([{"function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}], "arguments holds a lone surrogate"),
    ],
)
def test_a_tool_call_no_template_could_render_is_refused_naming_messages(tool_calls, reason):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": tool_calls}]
    with pytest.raises(APIError) as refused:
        chat_prompt({"messages": messages}, tokenizer_with(TOJSON_TEMPLATE), LIMITS)
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert "message 1: " in refused.value.message and reason in refused.value.message, refused.value.message


def test_text_content_parts_join_with_newlines():
    tokenizer = tokenizer_with(TOJSON_TEMPLATE)
    parts = [{"type": "text", "text": "Here is the document."}, {"type": "text", "text": "Summarize it."}]
    ids = chat_prompt({"messages": [{"role": "user", "content": parts}]}, tokenizer, LIMITS)
    assert ids == reference(tokenizer, [{"role": "user", "content": "Here is the document.\nSummarize it."}])
