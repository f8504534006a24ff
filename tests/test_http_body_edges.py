"""What a request body says besides its fields, found by an attack review of the HTTP API, against an in-process
server: a key given twice (JSON parsers keep the last silently), an encoded body or another charset, query
parameters on a route that reads a JSON body, lone surrogates wherever they are, and bans that leave no first token
to draw (a 500 at generation before, now a 400 at intake). Each is refused by name, and the connection still serves
the next request."""

from __future__ import annotations

import gzip
import json

import httpx2 as httpx  # the HTTP library the openai client is built on
import pytest

from rollout.config import ContinuousBatchingConfig
from rollout.engine.manager.continuous_batching import init_continuous_batching
from rollout.presets import tiny_model, tiny_tokenizer
from rollout.service.http.serving.server import HttpServer
from rollout.service.http.serving.settings import HttpSettings

JSON = {"Content-Type": "application/json"}
ORDINARY = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def http():
    tokenizer = tiny_tokenizer()
    config = ContinuousBatchingConfig(num_blocks=64, block_size=16)
    manager = init_continuous_batching(tiny_model(), continuous_batching_config=config, tokenizer=tokenizer).start()
    server = HttpServer(manager, tokenizer, HttpSettings()).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client
    finally:
        server.stop()
        manager.stop(block=True, timeout=30)


def refused(response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def test_a_key_given_twice_is_refused_naming_it(http):
    tokens = ",".join(["5"] * 100)  # a long token-id prompt: its numbers are skipped by the check, not its keys
    for body, key, path in (
        (
            '{"prompt": "hi", "max_tokens": 3, "max_tokens": 9}',
            "max_tokens",
            "max_tokens",
        ),
        ('{"prompt": "hi", "max_tokens": 2, "logit_bias": {"50": 100, "50": -100}}', "50", "logit_bias.50"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "a", "content": "b"}], '
            '"max_tokens": 2}',
            "content",
            "messages[1].content",
        ),
        (f'{{"prompt": [{tokens}], "max_tokens": 2, "n": 1, "n": 2}}', "n", "n"),
        (
            '{"prompt": "hi", "max_tokens": 2, "seed": NaN, "seed": 1}',  # json.loads' path (orjson refuses NaN)
            "seed",
            "seed",
        ),
    ):
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        message = refused(http.post(route, content=body, headers=JSON), 400, path)
        assert f"{key!r} is given twice in one JSON object ({path})" in message
    # The same key in two objects is no duplicate.
    body = '{"prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_object"}, "type": "x"}'
    assert "type: unknown field" in refused(http.post("/v1/completions", content=body, headers=JSON), 400, "type")
    assert http.post("/v1/completions", json=ORDINARY).status_code == 200


def test_an_encoded_body_or_another_charset_is_refused_naming_the_header(http):
    packed = gzip.compress(json.dumps(ORDINARY).encode())
    response = http.post("/v1/completions", content=packed, headers=JSON | {"Content-Encoding": "gzip"})
    assert "Content-Encoding 'gzip'" in refused(response, 415, None)
    plain = json.dumps(ORDINARY).encode()
    response = http.post("/v1/completions", content=plain, headers=JSON | {"Content-Encoding": "gzip"})  # mislabelled
    assert response.status_code == 415 and response.headers["connection"] == "close"
    latin = {"Content-Type": "application/json; charset=latin-1"}
    response = http.post(
        "/v1/completions", content='{"prompt": "caf\u00e9", "max_tokens": 2}'.encode("latin-1"), headers=latin
    )
    assert "not as charset 'latin-1'" in refused(response, 415, None)
    utf16 = json.dumps(ORDINARY).encode("utf-16")  # json.loads alone would detect it and read it
    assert "UnicodeDecodeError" in refused(http.post("/v1/completions", content=utf16, headers=JSON), 400, None)
    for header in (
        "application/json; charset=utf-8",
        'application/json; charset="UTF-8"',
        "application/json; charset=us-ascii",
    ):
        assert http.post("/v1/completions", content=plain, headers={"Content-Type": header}).status_code == 200
    assert (
        http.post("/v1/completions", content=plain, headers=JSON | {"Content-Encoding": "identity"}).status_code == 200
    )


def test_query_parameters_on_a_json_route_are_refused_naming_them(http):
    for path, query in (("/v1/completions", "stream=true"), ("/v1/completions", "max_tokens=1"), ("/tokenize", "x=1")):
        name = query.split("=")[0]
        message = refused(http.post(f"{path}?{query}", json=ORDINARY), 400, f"query.{name}")
        assert "reads its fields from the JSON body" in message
    assert http.post("/v1/completions", json=ORDINARY).status_code == 200  # the same connection serves on


@pytest.mark.parametrize(
    "path, body, param, where",
    [
        ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop", "stop[0]"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "\\ud800", "content": "hi"}]}',
            "messages",
            "messages[0].role",
        ),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt", "prompt"),
    ],
)
def test_a_lone_surrogate_anywhere_is_named_where_it_is(http, path, body, param, where):
    message = refused(http.post(path, content=body, headers=JSON), 400, param)
    assert message.startswith(f"{where}: holds a lone surrogate (\\ud800)")


def test_bans_that_leave_no_first_token_are_a_400_before_generation(http):
    everything = list(range(tiny_model().config.vocab_size))
    for body, param in (
        ({"min_tokens": 5, "stop_token_ids": everything}, "stop_token_ids"),
        ({"min_tokens": 5, "stop_token_ids": everything, "n": 3, "logprobs": 1}, "stop_token_ids"),
    ):
        message = refused(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 6, **body}), 400, param)
        assert "together ban all 1024 tokens" in message and "min_new_tokens masks them" in message
    # One token left to draw: served.
    response = http.post("/v1/completions", json={**ORDINARY, "min_tokens": 1, "stop_token_ids": everything[1:]})
    assert response.status_code == 200, response.text


def test_a_refused_prompt_of_a_batch_is_named_by_its_place(http):
    response = http.post("/v1/completions", json={"prompt": ["hi", ""], "max_tokens": 2})
    assert refused(response, 400, "prompt") == "prompt: item 1 of the batch: encodes to no tokens"


def test_naming_a_key_given_twice_costs_no_more_than_the_body():
    """The path of the key given twice is written out alone: a long key above a long array, then the duplicate,
    had made every array item a copy of the long path (gigabytes from a 300 KB body; a 400 in the end)."""
    import tracemalloc

    from rollout.service.http.errors import APIError
    from rollout.service.http.serving.json_body import parse_json

    long_key = "k" * 40_000
    body = json.dumps({"prompt": "hi", "x": {long_key: [0] * 100_000}}).encode()[:-1] + b', "y": {"n": 1, "n": 2}}'
    tracemalloc.start()
    try:
        with pytest.raises(APIError) as refused:
            parse_json(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (refused.value.status, refused.value.param) == (400, "y.n")
    assert peak < 200 * len(body), peak  # about 70 times: the parse; 4 GB before


def test_the_messages_as_a_template_variable_are_named_where_they_were_sent(http):
    """`chat_template_kwargs.messages` collides with the template's own `messages`: the 400 named `messages`, which
    the client had sent right, and said only that the template failed."""
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "chat_template_kwargs": {"messages": messages}}
    for path, extra in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
        message = refused(http.post(path, json=body | extra), 400, "chat_template_kwargs")
        assert message.startswith("chat_template_kwargs.messages: set it as the request's `messages` field"), message
