"""Tool calls through the HTTP API, end to end with the official `openai` client: a scripted model whose logits really
spell a hermes `<tool_call>` (a random model never emits one), served with --tool-call-parser hermes; the calls
come back in `message.tool_calls` and, streamed, as `delta.tool_calls` that the openai package's own stream state
reassembles; the tokens and log-probs are still every token's."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState
from transformers import Qwen3Config, Qwen3ForCausalLM

from rollout.config import ContinuousBatchingConfig
from rollout.engine.manager.continuous_batching import init_continuous_batching
from rollout.presets import TINY_MODEL_CONFIG, tiny_tokenizer
from rollout.service.http.serving.server import HttpServer
from rollout.service.http.serving.settings import TOOL_CALL_PARSER_NAMES, HttpSettings
from rollout.service.http.tools.tool_calls import TOOL_CALL_PARSERS

CALL = {"name": "count_letters", "arguments": {"text": "abc"}}  # examples/agent_openai.py's tool
TOOLS = [{"type": "function", "function": {"name": "count_letters", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "count the letters of abc"}]


def scripted_tool_caller(call: str = json.dumps(CALL), then: tuple[str, ...] = ()):
    """A tokenizer with three added words (`<tool_call>`, the call's JSON `call`, `</tool_call>`) and a Qwen3 model
    whose layers add nothing (each position's output is its own token's embedding), so its next token is a function
    of the current one: greedy decoding after the chat template's "assistant\\n" spells the call, then ends the turn
    (after the added words `then`, if any: a second call written as one word, say)."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<tool_call>", call, "</tool_call>", *then])
    chain = [tokenizer.convert_tokens_to_ids(t) for t in ("\n", "<tool_call>", call, "</tool_call>", *then)]
    chain.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    config = Qwen3Config(**{**TINY_MODEL_CONFIG, "vocab_size": len(tokenizer)}, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = chain[-1]  # a chat model's turn ends at <|im_end|> (as Qwen's config says)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for step, (token, following) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(torch.tensor(step), 256) * 1.0
            model.lm_head.weight[:, step] = 0.0
            model.lm_head.weight[following, step] = 1.0  # logit sqrt(256) = 16 after the final norm
    return model, tokenizer


@pytest.fixture(scope="module")
def scripted():
    return scripted_tool_caller()


@contextmanager
def serving(model, tokenizer):
    """The scripted model behind an HTTP server with the hermes parser."""
    config = ContinuousBatchingConfig(num_blocks=64, block_size=16)
    manager = init_continuous_batching(model, continuous_batching_config=config, tokenizer=tokenizer).start()
    settings = HttpSettings(max_n=8, max_prompt_len=1024, tool_call_parser="hermes")
    http = HttpServer(manager, tokenizer, settings).start()
    try:
        yield http
    finally:
        http.stop()
        manager.stop()


@pytest.fixture(scope="module")
def server(scripted):
    with serving(*scripted) as http:
        yield http


@pytest.fixture(scope="module")
def api(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def test_a_tool_call_comes_back_in_message_tool_calls(api):
    answer = api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        temperature=0,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "count_letters"
    assert json.loads(call.function.arguments) == CALL["arguments"] and call.id
    assert len(choice.model_extra["token_ids"]) == len(choice.logprobs.content) == 4  # every token's log-prob


def test_a_streamed_tool_call_reassembles_in_the_openai_stream_state(api):
    state = ChatCompletionStreamState()
    with api.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0, stream=True
    ) as stream:
        for chunk in stream:
            state.handle_chunk(chunk)
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "count_letters" and json.loads(call.function.arguments) == CALL["arguments"]


def test_tool_choice_none_renders_the_tools_and_parses_nothing(api):
    answer = api.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == f"<tool_call>{json.dumps(CALL)}</tool_call>"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "count_letters"}}])
def test_constrained_tool_choices_are_refused_by_name(api, tool_choice):
    with pytest.raises(openai.BadRequestError) as raised:
        api.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice)
    assert raised.value.body["param"] == "tool_choice"


def test_the_flag_offers_every_parser():
    assert set(TOOL_CALL_PARSER_NAMES) == set(TOOL_CALL_PARSERS)


def test_the_agent_example_round_trips_tool_calls(server, scripted):
    """examples/agent_openai.py --tool-calls: each turn's call parsed by the worker, run, and answered with a tool
    message the next turn's prompt renders; every turn keeps its own token ids and log-probs."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import agent_openai

    args = ["--base-url", f"{server.url}/v1", "--tool-calls", "--episodes", "1", "--turns", "2", "--max-tokens", "8"]
    [rows] = agent_openai.main(args)
    assert len(rows) == 2
    for row in rows:
        assert row.tool_calls == [CALL] and row.tool_results == ['{"letters": 3}']
        assert len(row.completion_ids) == len(row.logprobs) == 4
    second_prompt = scripted[1].decode(rows[1].prompt_ids)
    assert second_prompt.count("<|im_start|>tool") == 1 and '{"letters": 3}' in second_prompt


@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1e999"])
def test_a_call_whose_arguments_json_cannot_hold_is_content(number):
    """A call holding NaN or Infinity (Python's json reads both; JSON has neither) or a number past a float's range
    is no tool call: its text comes back as content, finish_reason "stop", as a call that does not parse."""
    call = f'{{"name": "count_letters", "arguments": {{"n": {number}}}}}'
    with serving(*scripted_tool_caller(call)) as http:
        with openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert choice.message.content == f"<tool_call>{call}</tool_call>"


def test_parallel_tool_calls_false_keeps_the_first_call_as_vllm():
    """`parallel_tool_calls: false` is honoured as vLLM honours it (`maybe_filter_parallel_tool_calls`): of the calls
    the model wrote, only the first comes back, whole and streamed; true or absent, every call does (it was
    accepted and had no effect: two calls came back)."""
    second = {"name": "count_letters", "arguments": {"text": "de"}}
    then = (f"<tool_call>{json.dumps(second)}</tool_call>",)
    with serving(*scripted_tool_caller(then=then)) as http:
        with openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            for parallel, expected in ((None, [CALL, second]), (True, [CALL, second]), (False, [CALL])):
                fields = {} if parallel is None else {"parallel_tool_calls": parallel}
                request = dict(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0, n=2, **fields)
                answer = client.chat.completions.create(**request)
                state = ChatCompletionStreamState()
                with client.chat.completions.create(**request, stream=True) as stream:
                    for chunk in stream:
                        state.handle_chunk(chunk)
                for choice in [*answer.choices, *state.get_final_completion().choices]:
                    calls = [
                        {"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                        for c in choice.message.tool_calls
                    ]
                    assert calls == expected, (parallel, calls)
                    assert choice.finish_reason == "tool_calls" and not choice.message.content
