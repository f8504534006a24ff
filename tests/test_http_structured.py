"""Structured outputs over HTTP: OpenAI's `response_format` (json_schema, json_object) and vLLM's
`structured_outputs` field, driven by the official `openai` client against a worker subprocess.

References: the grammar's own acceptance (`json.loads` + `jsonschema`, `re.fullmatch`, choice membership) and
transformers' greedy `generate` with xgrammar's LogitsProcessor for the same model."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from rollout.presets import tiny_tokenizer  # noqa: E402

TOKENIZER = tiny_tokenizer()
MESSAGES = [{"role": "user", "content": "describe a ball in JSON"}]
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer", "minimum": 0}},
    "required": ["color", "size"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{1,3}"


@pytest.fixture(scope="module")
def api(http_worker):
    with openai.OpenAI(base_url=f"{http_worker.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "ball", "schema": schema, "strict": True}}


def test_the_openai_client_gets_valid_json_in_every_choice(api):
    answer = api.chat.completions.create(
        model="tiny", messages=MESSAGES, n=8, seed=1, max_tokens=64, response_format=json_schema_format(SCHEMA)
    )
    assert len(answer.choices) == 8
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_in_completions_and_a_streamed_chat(api):
    answer = api.completions.create(
        model="tiny", prompt="{", n=8, seed=2, max_tokens=96, extra_body={"response_format": {"type": "json_object"}}
    )  # the openai client's completions take response_format as an extra field (vLLM's completions honour it)
    finished = [choice.text for choice in answer.choices if choice.finish_reason == "stop"]
    assert len(finished) >= 4
    assert all(isinstance(json.loads(text), dict) for text in finished)
    stream = api.chat.completions.create(
        model="tiny", messages=MESSAGES, seed=3, max_tokens=64, stream=True, response_format=json_schema_format(SCHEMA)
    )
    pieces, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads("".join(pieces)), SCHEMA)


def test_vllm_structured_outputs_regex_choice_and_grammar(api):
    answer = api.completions.create(
        model="tiny", prompt="ok?", n=8, seed=4, max_tokens=16, extra_body={"structured_outputs": {"regex": REGEX}}
    )
    assert all(re.fullmatch(REGEX, choice.text) and choice.finish_reason == "stop" for choice in answer.choices)
    choices = ["alpha", "beta", "gamma"]
    chat = api.chat.completions.create(
        model="tiny", messages=MESSAGES, n=8, seed=5, extra_body={"structured_outputs": {"choice": choices}}
    )
    assert all(choice.message.content in choices for choice in chat.choices)
    grammar = 'root ::= "x=" [0-9] [0-9]? ";"'
    body = {"structured_outputs": {"grammar": grammar, "disable_fallback": True}}
    answer = api.completions.create(model="tiny", prompt="set", n=4, seed=6, max_tokens=8, extra_body=body)
    assert all(re.fullmatch(r"x=[0-9][0-9]?;", choice.text) for choice in answer.choices)


def test_top_logprobs_of_tokens_a_grammar_rules_out_are_finite(api):
    """Where the grammar leaves fewer tokens than top_logprobs asks for, the rest have log-prob -inf: sent as
    vLLM's -9999.0, since JSON has no infinity (whole answers and streams)."""
    body = {"structured_outputs": {"choice": ["yes", "no"]}}
    answer = api.chat.completions.create(
        model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=3, extra_body=body
    )
    tops = [top.logprob for entry in answer.choices[0].logprobs.content for top in entry.top_logprobs]
    assert -9999.0 in tops and all(value >= -9999.0 for value in tops)
    stream = api.completions.create(model="tiny", prompt="ok?", logprobs=3, stream=True, extra_body=body)
    streamed = [
        v
        for chunk in stream
        for c in chunk.choices
        if c.logprobs
        for row in c.logprobs.top_logprobs
        for v in row.values()
    ]
    assert -9999.0 in streamed


def test_greedy_regex_over_http_equals_transformers_with_xgrammars_processor(api):
    from test_structured_outputs import compiled, hf_constrained_greedy  # its MODEL is the worker's: tiny_model(0)

    prompt = TOKENIZER("ok?")["input_ids"]
    answer = api.completions.create(
        model="tiny",
        prompt=prompt,
        temperature=0,
        max_tokens=16,
        extra_body={"structured_outputs": {"regex": REGEX}, "return_token_ids": True},
    )
    expected = hf_constrained_greedy(prompt, compiled("regex", REGEX), 16)
    assert answer.choices[0].model_extra["token_ids"] == expected


def valid_ball(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


BAD_CONSTRAINTS = [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs.backend"),
    ({"response_format": json_schema_format({"type": "nope"})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"json": "[" * 3000 + "]" * 3000}}, "structured_outputs.json"),  # deeper than Python
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs.regex"),  # no token can start it
    ({"structured_outputs": {"choice": ["a"]}, "min_tokens": 3}, "structured_outputs.choice"),  # always shorter
    (
        {"response_format": json_schema_format({"type": "array", "uniqueItems": True})},
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize(("extra", "param"), BAD_CONSTRAINTS)
def test_a_bad_constraint_is_a_400_naming_the_field(api, extra, param):
    with pytest.raises(openai.BadRequestError) as raised:
        api.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
    assert raised.value.body["param"] == param, raised.value.body


def test_200_random_valid_and_invalid_constraints_keep_the_worker_serving(http_worker):
    """Concurrent requests, each a random valid or invalid constraint: every valid one gets completions its grammar
    accepts, every invalid one a 400 naming its field, and plain requests sent meanwhile are all served."""
    rng = random.Random(0)
    letters = rng.randint(1, 9)
    valid = [
        ({"structured_outputs": {"regex": REGEX}}, lambda text: bool(re.fullmatch(REGEX, text))),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda text: text in ("up", "down")),
        ({"response_format": json_schema_format(SCHEMA)}, valid_ball),
        ({"structured_outputs": {"regex": f"[a-z]{{{letters}}}"}}, lambda text: bool(re.fullmatch("[a-z]+", text))),
    ]

    def send(index: int) -> tuple[str, bool]:
        if index % 10 == 0:  # everyone else: a plain request
            response = httpx.post(f"{http_worker.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            return "plain", response.status_code == 200
        local = random.Random(index)
        if local.random() < 0.5:
            extra, param = BAD_CONSTRAINTS[local.randrange(len(BAD_CONSTRAINTS))]
            body = {"prompt": "x", "max_tokens": 4, **extra}
            response = httpx.post(f"{http_worker.url}/v1/completions", json=body, timeout=60)
            return "invalid", response.status_code == 400 and response.json()["error"]["param"] == param
        extra, accepts = valid[local.randrange(len(valid))]
        body = {"prompt": "go", "max_tokens": 64, "seed": index, **extra}
        response = httpx.post(f"{http_worker.url}/v1/completions", json=body, timeout=60)
        texts = [choice["text"] for choice in response.json()["choices"]]
        return "valid", response.status_code == 200 and all(accepts(text) for text in texts)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(send, range(200)))
    failed = [(index, kind) for index, (kind, ok) in enumerate(results) if not ok]
    assert not failed
    assert {kind for kind, _ in results} == {"plain", "invalid", "valid"}
    assert httpx.get(f"{http_worker.url}/health").status_code == 200


def test_a_grammar_the_request_makes_impossible_mid_output_is_a_400_not_a_500(http_worker):
    """`min_tokens` past every output of a small regex that admission cannot decide (its search is bounded): the
    samples reach a dead end while generating. That is the request's doing, the same on every retry: a 400 naming
    the grammar and min_tokens, whole or streamed (a 500, which clients retry, before); the server serves on."""
    body = {"prompt": "x", "max_tokens": 80, "min_tokens": 60, "structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}}
    response = httpx.post(f"{http_worker.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "min_tokens" in error["message"], error
    with httpx.stream("POST", f"{http_worker.url}/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: {")]
    assert '"invalid_request_error"' in events[-1] and "min_tokens" in events[-1], events[-1]
    plain = httpx.post(f"{http_worker.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert plain.status_code == 200


def test_properties_come_in_the_order_the_schema_declares_them(api):
    """As OpenAI and vLLM write them: "size" declared first comes first (the schema's keys were sorted on the way)."""
    schema = {**SCHEMA, "properties": {"size": SCHEMA["properties"]["size"], "color": SCHEMA["properties"]["color"]}}
    answer = api.chat.completions.create(
        model="tiny", messages=MESSAGES, n=4, seed=1, max_tokens=64, response_format=json_schema_format(schema)
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice
        pairs = json.loads(choice.message.content, object_pairs_hook=list)
        assert [key for key, _ in pairs] == ["size", "color"], choice.message.content
