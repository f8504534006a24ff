"""Edges of the HTTP front end found by review, driven by the official `openai` client against an in-process server
whose engine runs: prompts at the limit of a KV cache smaller than the context, and the text offsets of an echoed
prompt whose text its tokens do not spell."""

from __future__ import annotations

import itertools

import openai
import pytest
import torch
from http_helpers import openai_client, serving

from rollout.presets import tiny_model, tiny_tokenizer
from rollout.service.http.serving.settings import HttpSettings

BLOCKS, BLOCK_SIZE = 4, 16
KV_TOKENS = BLOCKS * BLOCK_SIZE  # far below the tiny model's 2048-token context
TOKENIZER = tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model().eval()


@pytest.fixture(scope="module")
def api(model):
    settings = HttpSettings(max_n=8, max_prompt_len=2048)
    with serving(model, TOKENIZER, settings, BLOCKS, BLOCK_SIZE) as http, openai_client(http.url) as client:
        yield client


def refused(call) -> dict:
    with pytest.raises(openai.BadRequestError) as raised:
        call()
    return raised.value.body


@pytest.mark.parametrize("max_tokens", [None, 1, 0])
def test_a_prompt_the_kv_cache_cannot_hold_is_refused_naming_the_prompt(api, max_tokens):
    # Without max_tokens (or with any value) the fault is the prompt's: never "max_tokens in [1, -6]", never a 500
    # from the engine for a scored prompt one token past the cache.
    extra = {"max_tokens": max_tokens, "echo": True, "logprobs": 0} if max_tokens is not None else {}
    error = refused(lambda: api.completions.create(model="tiny", prompt=[5] * (KV_TOKENS + 1), **extra))
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert f"at most {KV_TOKENS}" in error["message"]


def test_a_chat_longer_than_the_kv_cache_is_refused_naming_the_messages(api):
    messages = [{"role": "user", "content": "x" * KV_TOKENS}]
    error = refused(lambda: api.chat.completions.create(model="tiny", messages=messages))
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"


def test_a_prompt_that_fills_the_kv_cache_is_scored_as_a_forward_pass_scores_it(api, model):
    prompt = [4 + (7 * i) % 90 for i in range(KV_TOKENS)]
    answer = api.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    expected = [expected[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    got = answer.choices[0].logprobs.token_logprobs
    assert got[0] is None and got[1:] == pytest.approx(expected, abs=1e-4)
    # One token of room after the longest prompt: sampled prompts fit too.
    answer = api.completions.create(model="tiny", prompt=prompt[:-1], max_tokens=1, extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 1


def token_text_offsets(ids: list[int]) -> list[int]:
    """vLLM's echo offsets: each token's text on its own, summed over the prompt's and then the completion's."""
    return [0, *itertools.accumulate(len(TOKENIZER.decode([t])) for t in ids[:-1])]


def test_echo_offsets_run_on_from_the_prompt_tokens_whatever_text_was_sent(api):
    prompt = "h\u00e9llo"  # the tiny vocabulary has no "é": it is <unk>, whose own text is 5 characters long
    fields = dict(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=0, seed=1)
    answer = api.completions.create(**fields, extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = answer.choices[0]
    ids = choice.model_extra["prompt_token_ids"] + choice.model_extra["token_ids"]
    assert TOKENIZER.unk_token_id in ids and choice.text.startswith(prompt)
    assert choice.logprobs.text_offset == token_text_offsets(ids)
    streamed = []
    for chunk in api.completions.create(**fields, stream=True, extra_body={"ignore_eos": True}):
        streamed += chunk.choices[0].logprobs.text_offset if chunk.choices and chunk.choices[0].logprobs else []
    assert streamed == choice.logprobs.text_offset


def test_logprobs_0_gives_each_position_its_own_token_as_vllm_does(api):
    # vLLM's top_logprobs hold the top k and the token itself: with k = 0, the token alone (never null), for the
    # echoed prompt (its first position excepted) and the completion, whole or streamed.
    fields = dict(model="tiny", prompt="hello", max_tokens=4, echo=True, logprobs=0, seed=2)
    logprobs = api.completions.create(**fields).choices[0].logprobs
    assert logprobs.top_logprobs[0] is None and len(logprobs.tokens) == len("hello") + 4
    assert logprobs.top_logprobs[1:] == [{t: lp} for t, lp in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:])]
    streamed = []
    for chunk in api.completions.create(**fields, stream=True):
        streamed += chunk.choices[0].logprobs.top_logprobs if chunk.choices and chunk.choices[0].logprobs else []
    assert streamed == logprobs.top_logprobs


def test_a_seed_past_64_bits_is_read_as_the_integer_sent(api):
    """orjson reads an integer past 64 bits as a float: such a body is parsed as `json.loads` reads it, so the seed
    stays the integer sent, and seeds sampling as any seed does (it was refused as "1.8446744073709552e+19 is
    invalid")."""
    import json

    from rollout.service.http.serving.json_body import parse_json

    for body in (
        b'{"seed": 18446744073709551616, "temperature": 1.5, "prompt": "12345678901234567890123"}',
        b'{"seed": -9223372036854775809, "x": [1e19, -12345678901234567890]}',  # 19 digits below -2**63; a float
    ):
        parsed = parse_json(body)
        assert parsed == json.loads(body) and [type(v) for v in parsed.values()] == [
            type(v) for v in json.loads(body).values()
        ]
    runs = [
        api.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=1.0, seed=2**64, logprobs=0)
        for _ in range(2)
    ]
    assert runs[0].choices[0].text == runs[1].choices[0].text
    tokens = [run.choices[0].logprobs.tokens for run in runs]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


@pytest.mark.parametrize("sent", [-1, "5", None, 1.5])
def test_a_bad_stop_token_id_is_named_as_sent(api, sent):
    """The refusal names the value the client sent, not the list it is merged into (the model's EOS first)."""
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"stop_token_ids": [7, sent]})
    assert refused.value.body["param"] == "stop_token_ids"
    assert refused.value.body["message"].endswith(f"got {sent!r} in it"), refused.value.body["message"]


def test_a_whole_answer_is_refused_with_its_gravest_choice_error():
    """n > 1, not streamed: one choice's request fault (400) came first, a later choice's engine failure (500) is
    what the answer says, as it would be alone; an answer with no error is no error."""
    from rollout.detokenizer import OutputText
    from rollout.service.http.api.answers import answer_error
    from rollout.service.http.api.choices import Choice

    def choice(index: int, finish_reason: str, error: str | None = None, request_fault: bool = False) -> Choice:
        text = OutputText(TOKENIZER, [1, 2])
        return Choice(index, [1, 2], text, finish_reason=finish_reason, error=error, request_fault=request_fault)

    banned = choice(0, "error", "every token is banned", request_fault=True)
    failed = choice(1, "error", "RuntimeError: out of memory")
    assert answer_error([banned, failed], unread=False).status == 500
    assert answer_error([failed, banned], unread=False).status == 500
    assert answer_error([banned, choice(1, "stop")], unread=False).code == "nothing_to_draw"
    assert answer_error([choice(0, "length"), choice(1, "abort")], unread=False) is None
    assert answer_error([banned, choice(1, "abort")], unread=True).status == 408
