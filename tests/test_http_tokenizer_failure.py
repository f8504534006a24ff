"""A tokenizer that fails to decode an output, over HTTP: the front end decodes every choice's text itself (not only
for stop strings), on the event loop that streams every answer. The request whose output it cannot decode is
answered with an OpenAI error naming the tokenizer (a whole answer's 500, a stream's last event before [DONE]), its
generation is cancelled, and the server serves on; it had been a bare "Internal Server Error" and a stream cut off
mid-answer."""

from __future__ import annotations

import json
import time

import httpx2 as httpx  # the HTTP library the openai client is built on
import openai
import pytest

from rollout.engine.manager.continuous_batching import init_continuous_batching
from rollout.presets import tiny_model, tiny_tokenizer
from rollout.service.http.serving.server import HttpServer
from rollout.service.http.serving.settings import HttpSettings

TOKENIZER = tiny_tokenizer()
PROMPT = "hello there: "


class FailingTokenizer:
    """The tiny tokenizer, whose decode raises on any ids holding `bad` (a custom tokenizer's bug)."""

    def __init__(self, bad: int):
        self.bad = bad

    def __getattr__(self, name: str):
        return getattr(TOKENIZER, name)

    def __call__(self, *args, **kwargs):
        return TOKENIZER(*args, **kwargs)

    def decode(self, ids, **kwargs):
        if self.bad in list(ids):
            raise RuntimeError("this tokenizer cannot decode that")
        return TOKENIZER.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def served():
    manager = init_continuous_batching(tiny_model().eval(), tokenizer=TOKENIZER).start()
    http = None
    try:
        greedy = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        plain = HttpServer(manager, TOKENIZER, HttpSettings(max_n=8, max_prompt_len=2048)).start()
        try:
            full = httpx.post(f"{plain.url}/v1/completions", json=greedy, timeout=60).json()["choices"][0]["token_ids"]
        finally:
            plain.stop()
        prompt_ids = TOKENIZER(PROMPT)["input_ids"]
        bad_at = next(i for i, token in enumerate(full) if i >= 2 and token not in prompt_ids)
        tokenizer = FailingTokenizer(full[bad_at])
        http = HttpServer(manager, tokenizer, HttpSettings(max_n=8, max_prompt_len=2048)).start()
        yield http, greedy, bad_at, manager
    finally:
        if http is not None:
            http.stop()
        manager.stop()


def test_a_whole_answer_the_tokenizer_cannot_decode_is_an_openai_error(served):
    http, greedy, bad_at, manager = served
    settings = {"prompt": PROMPT, "temperature": 0, "extra_body": {"ignore_eos": True}}
    with openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.InternalServerError) as raised:
            client.completions.create(model="tiny", max_tokens=1500, **settings)
        assert raised.value.status_code == 500 and "tokenizer failed" in raised.value.body["message"]
        assert_generation_ends(manager)
        # The server serves on: the same request, ended before the token that cannot be decoded.
        answer = client.completions.create(model="tiny", max_tokens=bad_at, **settings)
        assert answer.choices[0].finish_reason == "length"


def test_a_stream_the_tokenizer_cannot_decode_ends_with_an_error_event(served):
    http, greedy, _, manager = served
    events = []
    body = {**greedy, "stream": True, "max_tokens": 1500}
    with httpx.stream("POST", f"{http.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert "tokenizer failed" in error["message"] and error["type"] == "internal_server_error"
    assert_generation_ends(manager)


def assert_generation_ends(manager) -> None:
    """The failed request's sample was cancelled, not left to generate its 1500 tokens for nobody."""
    deadline = time.monotonic() + 5
    while manager.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert manager.stats()["running"] == 0
    assert manager.stats()["generated_tokens"] < 1000


def test_ids_the_tokenizer_cannot_decode_are_a_400_naming_tokens():
    """/detokenize, as /tokenize's text the tokenizer cannot encode: the client's ids, named (it was a bare 500)."""
    from rollout.service.http.api.prompts import PromptLimits
    from rollout.service.http.api.tokenize import TokenizeEndpoints
    from rollout.service.http.errors import APIError

    endpoints = TokenizeEndpoints(FailingTokenizer(5), "tiny", 1024, 2048, PromptLimits(2047))
    assert endpoints.detokenize({"tokens": [6, 7]}) == TOKENIZER.decode([6, 7])
    with pytest.raises(APIError) as raised:
        endpoints.detokenize({"tokens": [6, 5]})
    assert raised.value.status == 400 and raised.value.param == "tokens"
    assert "cannot decode" in raised.value.message
