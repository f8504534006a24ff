"""`rollout-worker --http`: the OpenAI-compatible front end, driven by the official `openai` client against a real
worker subprocess that also serves ZeroMQ; answers checked against the ZeroMQ path, the tokenizer's own chat
template and full decodes."""

from __future__ import annotations

import re
import threading
import time

import httpx2 as httpx  # the HTTP library the openai client is built on
import openai
import pytest

from rollout import SamplingParams
from rollout import protocol as p
from rollout.presets import tiny_tokenizer
from service_helpers import Client
from trainer_bridge import PromptGroup, RolloutClient

TOKENIZER = tiny_tokenizer()
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a color"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def worker(http_worker):
    return http_worker


@pytest.fixture(scope="module")
def api(worker):
    with openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def zmq_client(worker):
    with RolloutClient(worker.address, timeout=60) as client:
        yield client


def zeromq_samples(zmq_client, prompt_ids, n, **sampling):
    result = zmq_client.generate(PromptGroup(prompt_ids, n=n, sampling=SamplingParams(**sampling)))
    return [(c.token_ids, c.logprobs) for c in result.completions]


def extra(choice) -> dict:
    return choice.model_extra


def test_completions_match_the_zeromq_path(api, zmq_client):
    prompt = "the quick brown fox"
    answer = api.completions.create(
        model="tiny", prompt=prompt, n=4, seed=3, max_tokens=12, logprobs=0, extra_body={"return_token_ids": True}
    )
    prompt_ids = TOKENIZER(prompt)["input_ids"]
    expected = zeromq_samples(zmq_client, prompt_ids, 4, seed=3, max_new_tokens=12)
    got = [(extra(c)["token_ids"], c.logprobs.token_logprobs) for c in answer.choices]
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert all(extra(c)["prompt_token_ids"] == prompt_ids for c in answer.choices)
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    for (_, http_logprobs), (_, zmq_logprobs) in zip(got, expected):
        assert http_logprobs == pytest.approx(zmq_logprobs, abs=1e-6)
    for choice in answer.choices:
        assert choice.text == TOKENIZER.decode(extra(choice)["token_ids"], skip_special_tokens=True)
        assert extra(choice)["policy_versions"] == [[0, 0]] and extra(choice)["kv_version_min"] == 0
    assert answer.usage.prompt_tokens == len(prompt_ids) and answer.usage.completion_tokens == 48


def test_chat_renders_the_tokenizers_template_and_matches_zeromq(api, zmq_client):
    answer = api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="none",  # rendered into the prompt, not parsed
        n=4,
        seed=5,
        max_tokens=10,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    template_ids = TOKENIZER.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True)["input_ids"]
    assert answer.model_extra["prompt_token_ids"] == template_ids
    expected = zeromq_samples(zmq_client, template_ids, 4, seed=5, max_new_tokens=10)
    for choice, (ids, logprobs) in zip(answer.choices, expected):
        assert extra(choice)["token_ids"] == ids
        assert [entry.logprob for entry in choice.logprobs.content] == pytest.approx(logprobs, abs=1e-6)
        assert [entry.token for entry in choice.logprobs.content] == [TOKENIZER.decode([t]) for t in ids]
        assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)
        assert choice.message.role == "assistant"


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_reassembles_to_the_whole_answer(api, chat):
    settings = dict(model="tiny", n=2, seed=11, max_tokens=14, extra_body={"return_token_ids": True})
    if chat:
        whole = api.chat.completions.create(messages=MESSAGES, logprobs=True, **settings)
        stream = api.chat.completions.create(
            messages=MESSAGES, logprobs=True, stream=True, stream_options={"include_usage": True}, **settings
        )
    else:
        whole = api.completions.create(prompt="stream me", logprobs=1, **settings)
        stream = api.completions.create(
            prompt="stream me", logprobs=1, stream=True, stream_options={"include_usage": True}, **settings
        )
    text, ids, logprobs, finish, usage = {}, {}, {}, {}, None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        i = choice.index
        text[i] = text.get(i, "") + (choice.delta.content if chat else choice.text)
        ids[i] = ids.get(i, []) + extra(choice)["token_ids"]
        if choice.logprobs is None:  # chat's first chunk per choice carries only its role, as vLLM's
            assert chat and choice.delta.role == "assistant" and not extra(choice)["token_ids"]
            continue
        entries = choice.logprobs.content if chat else choice.logprobs.token_logprobs
        logprobs[i] = logprobs.get(i, []) + [e.logprob if chat else e for e in entries]
        finish[i] = choice.finish_reason or finish.get(i)
    for choice in whole.choices:
        i = choice.index
        assert text[i] == (choice.message.content if chat else choice.text)
        assert ids[i] == extra(choice)["token_ids"]
        expected = [e.logprob for e in choice.logprobs.content] if chat else choice.logprobs.token_logprobs
        assert logprobs[i] == pytest.approx(expected, abs=1e-6)
        assert finish[i] == choice.finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_returned_token_ids_continue_without_retokenizing(api):
    prompt = "continue: "
    greedy = dict(model="tiny", temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = api.completions.create(prompt=prompt, max_tokens=8, **greedy).choices[0]
    first = api.completions.create(prompt=prompt, max_tokens=4, **greedy).choices[0]
    history = extra(first)["prompt_token_ids"] + extra(first)["token_ids"]
    second = api.completions.create(prompt=history, max_tokens=4, **greedy).choices[0]
    assert extra(second)["prompt_token_ids"] == history
    assert extra(first)["token_ids"] + extra(second)["token_ids"] == extra(whole)["token_ids"]
    assert first.text + second.text == whole.text
    assert TOKENIZER.decode(history, skip_special_tokens=True) == prompt + first.text


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_across_token_boundaries(api, include):
    settings = dict(model="tiny", prompt="stop here", seed=2, max_tokens=20)
    full = api.completions.create(**settings, extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    ids = extra(full)["token_ids"]
    pieces = [TOKENIZER.decode([t], skip_special_tokens=True) for t in ids]
    stop = next(a[-1] + b[:1] for a, b in zip(pieces[5:], pieces[6:]) if a and b)  # spans a token boundary
    extra_body = {"return_token_ids": True, "ignore_eos": True, "include_stop_str_in_output": include}
    stopped = api.completions.create(**settings, stop=[stop], extra_body=extra_body).choices[0]
    # Reference: the first prefix of the full output whose decoded text contains the stop string.
    keep = next(k for k in range(1, len(ids) + 1) if stop in TOKENIZER.decode(ids[:k], skip_special_tokens=True))
    reference_text = TOKENIZER.decode(ids[:keep], skip_special_tokens=True)
    end = reference_text.find(stop)
    assert extra(stopped)["token_ids"] == ids[:keep]
    assert stopped.text == reference_text[: end + len(stop) if include else end]
    assert stopped.finish_reason == "stop" and extra(stopped)["stop_reason"] == stop
    streamed = api.completions.create(**settings, stop=[stop], stream=True, extra_body=extra_body)
    assert "".join(chunk.choices[0].text for chunk in streamed) == stopped.text


def test_zeromq_hello_and_stats_report_the_tokenizer(worker):
    client = Client(worker.address)
    try:
        assert client.ask(p.Hello()).tokenizer == "tiny"
        assert client.ask(p.Stats()).stats["tokenizer"] == "tiny"
    finally:
        client.close()


def test_stop_strings_over_zeromq_end_where_http_ends(api, zmq_client):
    prompt_ids = TOKENIZER("zeromq stops")["input_ids"]
    full = zeromq_samples(zmq_client, prompt_ids, 1, seed=4, max_new_tokens=20, stop_token_ids=())[0][0]
    stop = TOKENIZER.decode(full[6:8], skip_special_tokens=True) or "zz"
    stopped = zeromq_samples(zmq_client, prompt_ids, 1, seed=4, max_new_tokens=20, stop_token_ids=(), stop=[stop])
    body = {"return_token_ids": True, "ignore_eos": True}
    answer = api.completions.create(
        model="tiny", prompt=prompt_ids, seed=4, max_tokens=20, stop=[stop], extra_body=body
    )
    assert stopped[0][0] == extra(answer.choices[0])["token_ids"] and len(stopped[0][0]) <= 8


def test_http_and_zeromq_clients_at_once(api, zmq_client):
    prompt_ids = TOKENIZER("together")["input_ids"]
    results: dict[str, object] = {}

    def over_zeromq():
        results["zmq"] = [zeromq_samples(zmq_client, prompt_ids, 2, seed=s, max_new_tokens=30) for s in range(3)]

    thread = threading.Thread(target=over_zeromq)
    thread.start()
    http = [
        api.completions.create(model="tiny", prompt=prompt_ids, n=2, seed=s, max_tokens=30, logprobs=0)
        for s in range(3)
    ]
    thread.join(60)
    for answer, samples in zip(http, results["zmq"]):
        for choice, (ids, logprobs) in zip(answer.choices, samples):
            assert TOKENIZER.decode(ids, skip_special_tokens=True) == choice.text
            assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-6)


def wait_idle(worker, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = worker.stats()
        if (stats["running"], stats["queued"], stats["kv_blocks_used"]) == (0, 0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_has_its_request_cancelled(worker, stream):
    body = {"model": "tiny", "prompt": "go on and on", "max_tokens": 1900, "ignore_eos": True, "stream": stream}
    before = wait_idle(worker)["generated_tokens"]
    if stream:
        with httpx.stream("POST", f"{worker.url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # generation is under way; now hang up
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{worker.url}/v1/completions", json=body, timeout=1.0)
    stats = wait_idle(worker)
    assert (stats["running"], stats["queued"], stats["kv_blocks_used"]) == (0, 0, 0)
    assert stats["generated_tokens"] - before < 1900  # cancelled, not finished


def test_models_health_tokenize_detokenize(worker, api):
    (model,) = api.models.list().data
    assert (model.id, model.model_extra["max_model_len"]) == ("tiny", 2048)
    retrieved = api.models.retrieve("tiny").model_dump()
    assert retrieved.pop("created") >= model.created and retrieved == model.model_dump(exclude={"created"})
    with pytest.raises(openai.NotFoundError) as missing:
        api.models.retrieve("gpt-4")
    assert missing.value.code == "model_not_found" and "serves `tiny`" in missing.value.message
    assert httpx.get(f"{worker.url}/health").json()["status"] == "ok"
    tokens = httpx.post(f"{worker.url}/tokenize", json={"prompt": "hi there"}).json()
    assert tokens["tokens"] == TOKENIZER("hi there")["input_ids"] and tokens["count"] == len(tokens["tokens"])
    chat = httpx.post(f"{worker.url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == TOKENIZER.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    text = httpx.post(f"{worker.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "hi there"}


def test_logit_bias_is_honoured_as_on_the_zeromq_path(api, zmq_client):
    prompt_ids = TOKENIZER("tell me")["input_ids"]
    bias = {"50": 100.0, "51": -100.0}
    answer = api.completions.create(
        model="tiny",
        prompt=prompt_ids,
        n=2,
        seed=9,
        max_tokens=6,
        logprobs=0,
        logit_bias=bias,
        extra_body={"return_token_ids": True},
    )
    expected = zeromq_samples(zmq_client, prompt_ids, 2, seed=9, max_new_tokens=6, logit_bias={50: 100.0, 51: -100.0})
    assert [extra(c)["token_ids"] for c in answer.choices] == [ids for ids, _ in expected] == [[50] * 6] * 2


def test_completions_top_logprobs_add_the_sampled_token_when_it_is_not_among_them(api):
    # A bias makes token 50 the top token about half the time it is drawn from: samples are in and out of the top 1.
    answer = api.completions.create(model="tiny", prompt="abc", seed=1, max_tokens=30, logprobs=1, logit_bias={"50": 7})
    logprobs = answer.choices[0].logprobs
    sizes = {len(top) for top in logprobs.top_logprobs}
    assert sizes == {1, 2}  # 2 entries where the sampled token is not the top one, as vLLM
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert top[token] == pytest.approx(logprob)


def test_fields_without_generation_semantics_are_accepted(api):
    answer = api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=2,
        user="u1",
        metadata={"run": "7"},
        store=False,
        service_tier="auto",
    )
    assert answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "made_up": 1}, 400, "made_up"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {str(t): 1 for t in range(301)}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5000": 1}}, 400, "logit_bias"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS}, 400, "tools"),  # no --tool-call-parser
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "x"}]}, 400, "tools"),
        ("/v1/completions", {"prompt": "x", "metadata": "tag"}, 400, "metadata"),
        ("/v1/completions", {"prompt": "x", "echo": "yes"}, 400, "echo"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # 0 only to score the prompt
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "return_routed_experts": True}, 400, "return_routed_experts"),  # dense
        ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "x", "stop": ["s"] * 33}, 400, "stop"),
        ("/v1/completions", {"prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"prompt": [5, 99999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/completions", {"prompt": [7] * 2100}, 400, "prompt"),
        ("/v1/completions", {"prompt": [7] * 2000, "max_tokens": 100}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [5000]}, 400, "stop_token_ids"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
        ("/v1/completions", {"prompt": [[5]] * 600, "n": 2}, 400, "n"),  # 1200 samples > --max-n
        (
            "/v1/completions",
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": "no"}},
            400,
            "stream_options",
        ),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": 0}, 400, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "echo": {}}, 400, "echo"),
        ("/v1/completions", {"prompt": "x", "best_of": True}, 400, "best_of"),
        ("/v1/completions", b'{"prompt": "x", "repetition_penalty": Infinity}', 400, "repetition_penalty"),
        ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt"),  # a lone surrogate
        ("/v1/completions", {"prompt": "x" * 70_000}, 400, "prompt"),  # longer than any 2048-token prompt
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_completion_tokens": 4, "max_tokens": "x"},
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "{{ 'a' * 9 }}"}},
            400,
            "chat_template_kwargs",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "parallel_tool_calls": "yes"}, 400, "parallel_tool_calls"),
        ("/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": "high"}, 400, "reasoning_effort"),
        ("/v1/chat/completions", {"messages": MESSAGES, "modalities": ["text", "audio"]}, 400, "modalities"),
        ("/v1/chat/completions", {"messages": MESSAGES, "functions": [{"name": "f"}]}, 400, "functions"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),  # no content
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": None}]}, 400, "messages"),
        ("/v1/completions", {"prompt": "x", "prompt_cache_key": 5}, 400, "prompt_cache_key"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"messages": MESSAGES, "prompt": "x"}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "tools": 5}, 400, "tools"),
        ("/v1/nothing", {}, 404, None),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_field(worker, path, body, status, param):
    if isinstance(body, bytes):  # JSON a client library would not write (Infinity)
        headers = {"Content-Type": "application/json"}
        response = httpx.post(f"{worker.url}{path}", content=body, headers=headers, timeout=30)
    else:
        response = httpx.post(f"{worker.url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"], error


@pytest.mark.parametrize(
    "path, body, param, says",
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt", r"prompt: holds a lone surrogate \(\\ud800\)"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\\udfff"}]}',
            "messages",
            r"messages\[1\]\.content: holds a lone surrogate \(\\udfff\)",
        ),
        # said as what SamplingParams takes (">= 0"), where the API takes -1 (vLLM's "disabled") too
        ("/v1/completions", b'{"prompt": "x", "top_k": -2}', "top_k", r"must be -1 or 0 \(disabled\) or a positive"),
        # Python's own message advised sys.set_int_max_str_digits(), which is the server's code, not the client's
        (
            "/v1/completions",
            b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}",
            None,
            r"an integer of over 4,300 digits",
        ),
    ],
    ids=["prompt", "chat", "top_k", "huge_integer"],
)
def test_a_value_no_field_can_take_is_named_where_it_is(worker, path, body, param, says):
    """JSON's "\\ud800" escape decodes to a lone surrogate, which no tokenizer encodes: the 400 says so and where (the
    chat answer said only that the template failed). So are a top_k under -1 and an integer too long to read."""
    response = httpx.post(f"{worker.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and re.search(says, error["message"]), error


def test_what_the_openai_client_sends_as_null_or_echoes_back_is_accepted(api):
    """A null carries no meaning: OpenAI fields rollout does not serve are refused by name with a value, accepted as
    null (clients send them so); an answer's message sent back as the next turn's history keeps its null and empty
    fields (`refusal`, `annotations`, and `parsed` from the client's parse helper: the template gets them as they
    are, as vLLM's does); a cache hint and an end-user id have no effect on the tokens."""
    first = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, seed=1)
    echoed = first.choices[0].message.model_dump() | {"annotations": [], "parsed": {"x": 70}}  # as the client's
    assert echoed["refusal"] is None and "function_call" in echoed
    history = [*MESSAGES, echoed, {"role": "user", "content": "another"}]
    nulls = dict(reasoning_effort=None, verbosity=None, audio=None, prediction=None, web_search_options=None)
    answer = api.chat.completions.create(
        model="tiny",
        messages=history,
        max_tokens=3,
        seed=1,
        modalities=["text"],
        prompt_cache_key="conversation-1",
        safety_identifier="user-1",
        extra_body=nulls | {"functions": None, "function_call": None},
    )
    plain = api.chat.completions.create(model="tiny", messages=history, max_tokens=3, seed=1)
    assert answer.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="0 scores the prompt only, which needs echo or prompt_logprobs"):
        api.completions.create(model="tiny", prompt="x", max_tokens=0)


def test_bodies_that_are_not_json_or_not_for_this_host_are_refused(worker, api):
    json_type = {"Content-Type": "application/json"}
    for content in (b"{not json", b"[" * 20_000 + b"]" * 20_000):  # (nested too deeply to parse)
        response = httpx.post(f"{worker.url}/v1/completions", content=content, headers=json_type, timeout=30)
        assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    deep = b"[" * 300_000 + b"]" * 300_000  # more containers than a body may hold: refused before parsing
    response = httpx.post(f"{worker.url}/v1/completions", content=deep, headers=json_type, timeout=30)
    assert response.status_code == 413 and "JSON arrays and objects" in response.json()["error"]["message"]
    form = httpx.post(f"{worker.url}/v1/completions", content=b'{"prompt": "x"}', timeout=30)  # no JSON type
    assert form.status_code == 415
    rebound = httpx.post(f"{worker.url}/v1/completions", json={"prompt": "x"}, headers={"Host": "evil.example"})
    assert rebound.status_code == 421  # a loopback server answers only loopback host names
    with pytest.raises(openai.NotFoundError):  # what the official client raises for a 404
        api.completions.create(model="other", prompt="x")
    assert api.completions.create(model="tiny", prompt="still serving", max_tokens=2).choices[0].finish_reason


def test_agent_example_rows_match_a_teacher_forced_forward(worker):
    """examples/agent_openai.py's multi-turn rows: the model's tokens carry the log-probs a plain forward of the
    same model gives over the whole conversation (so nothing was re-tokenized between turns), tool tokens are
    masked out, and every model token has its policy version."""
    import sys
    from pathlib import Path

    import torch

    from rollout.presets import tiny_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import agent_openai

    episodes = agent_openai.main(["--base-url", f"{worker.url}/v1", "--episodes", "2", "--turns", "3"])
    model = tiny_model()
    for episode in episodes:
        assert episode.turns == 3 and 0 < sum(episode.completion_mask) < len(episode.completion_ids)
        assert episode.policy_versions == [0] * sum(episode.completion_mask)
        sequence = torch.tensor([episode.prompt_ids + episode.completion_ids])
        with torch.no_grad():
            logits = model(sequence).logits[0, len(episode.prompt_ids) - 1 : -1]
        forward = torch.log_softmax(logits.float(), -1).gather(-1, sequence[0, len(episode.prompt_ids) :, None])[:, 0]
        model_positions = [i for i, m in enumerate(episode.completion_mask) if m]
        expected = forward[model_positions].tolist()
        assert [episode.logprobs[i] for i in model_positions] == pytest.approx(expected, abs=1e-4)
        assert all(episode.logprobs[i] == 0.0 for i, m in enumerate(episode.completion_mask) if not m)


def test_a_stop_tokens_text_is_left_out_as_in_vllm(api):
    greedy = dict(model="tiny", prompt="stop token", temperature=0, max_tokens=12)
    full = api.completions.create(**greedy, extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    stop_id = extra(full)["token_ids"][4]
    body = {"return_token_ids": True, "ignore_eos": True, "stop_token_ids": [stop_id]}
    stopped = api.completions.create(**greedy, extra_body=body).choices[0]
    ids = extra(stopped)["token_ids"]
    assert ids[-1] == stop_id and stopped.finish_reason == "stop" and extra(stopped)["stop_reason"] == stop_id
    assert stopped.text == TOKENIZER.decode(ids[:-1], skip_special_tokens=True)
    kept = api.completions.create(**greedy, extra_body={**body, "include_stop_str_in_output": True}).choices[0]
    assert kept.text == TOKENIZER.decode(ids, skip_special_tokens=True)


def teacher_forced_logprobs(prompt_ids: list[int]):
    """(len(prompt) - 1, vocab) fp32 log-probs of positions 1.. from one forward of the worker's model."""
    import torch

    from rollout.presets import tiny_model

    with torch.no_grad():
        logits = tiny_model()(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)


def test_an_lm_eval_loglikelihood_request_matches_a_teacher_forced_forward(worker):
    """lm-evaluation-harness's `local-completions` loglikelihood request (its documented shape: token ids, echo,
    logprobs=1, max_tokens=1, temperature 0), read as it reads the answer: the continuation's summed log-prob and
    whether it is the greedy one."""
    contexts = [TOKENIZER("the capital of france is")["input_ids"], TOKENIZER("two plus two is")["input_ids"]]
    continuations = [TOKENIZER(" paris")["input_ids"], TOKENIZER(" four")["input_ids"]]
    prompts = [c + x for c, x in zip(contexts, continuations)]
    body = {
        "model": "tiny",
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    answer = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60).json()
    choices = sorted(answer["choices"], key=lambda choice: choice["index"])
    for choice, prompt, context in zip(choices, prompts, contexts):
        logprobs = choice["logprobs"]
        assert choice["text"].startswith(TOKENIZER.decode(prompt))
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1 and logprobs["token_logprobs"][0] is None
        assert logprobs["top_logprobs"][0] is None and logprobs["tokens"][: len(prompt)] == [
            TOKENIZER.decode([t]) for t in prompt
        ]
        expected = teacher_forced_logprobs(prompt)
        chosen = expected.gather(1, torch_tensor(prompt[1:])[:, None])[:, 0]
        assert logprobs["token_logprobs"][1 : len(prompt)] == pytest.approx(chosen.tolist(), abs=1e-5)
        ctxlen = len(context)  # lm-eval's parse_logprobs: the continuation is [ctxlen:-1]
        continuation_sum = sum(logprobs["token_logprobs"][ctxlen:-1])
        greedy = all(
            lp == max(top.values())
            for lp, top in zip(logprobs["token_logprobs"][ctxlen:-1], logprobs["top_logprobs"][ctxlen:-1])
        )
        assert continuation_sum == pytest.approx(float(chosen[ctxlen - 1 :].sum()), abs=1e-4)
        assert greedy == bool((expected[ctxlen - 1 :].argmax(-1) == torch_tensor(prompt[ctxlen:])).all())


def torch_tensor(values):
    import torch

    return torch.tensor(values)


def test_max_tokens_0_scores_the_prompt_only_and_prompt_logprobs_carry_ranks(worker):
    prompt = TOKENIZER("score me please")["input_ids"]
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0, "prompt_logprobs": 2}
    choice = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["text"] == TOKENIZER.decode(prompt) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt)
    expected = teacher_forced_logprobs(prompt)
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for position, entry in enumerate(entries[1:]):
        token = prompt[position + 1]
        own = entry[str(token)]
        rank = int((expected[position] > expected[position, token]).sum()) + 1
        assert own["rank"] == rank and own["logprob"] == pytest.approx(float(expected[position, token]), abs=1e-5)
        top_ids = expected[position].topk(2).indices.tolist()
        assert all(str(t) in entry for t in top_ids) and len(entry) == (2 if token in top_ids else 3)


def test_a_streamed_echo_starts_with_the_prompt(api):
    chunks = list(
        api.completions.create(model="tiny", prompt="echo this", max_tokens=3, echo=True, logprobs=0, stream=True)
    )
    first = chunks[0].choices[0]
    assert first.text.startswith("echo this") and first.logprobs.token_logprobs[0] is None
    tokens = sum((c.choices[0].logprobs.tokens for c in chunks if c.choices and c.choices[0].logprobs), [])
    # The text skips special tokens (skip_special_tokens defaults on, as in vLLM); the log-prob entries name every
    # token, <unk> included, as vLLM's do.
    shown = [token for token in tokens if token not in TOKENIZER.all_special_tokens]
    assert "".join(shown) == "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.mark.parametrize("seed", range(4))
def test_streamed_chat_choices_reassemble_in_the_openai_stream_state(api, seed):
    """n>1 streams whose choices finish in any order (stop strings) reassemble in the openai package's own stream
    state into what the same request answers whole, every token's log-prob once."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    request = dict(model="tiny", messages=MESSAGES, n=3, seed=seed, max_tokens=12, stop=["a"], logprobs=True)
    whole = api.chat.completions.create(**request, extra_body={"return_token_ids": True})
    state = ChatCompletionStreamState()
    with api.chat.completions.create(**request, stream=True) as stream:
        for chunk in stream:
            state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot  # (get_final_completion refuses answers cut by max_tokens)
    for got, expected in zip(streamed.choices, whole.choices):
        assert got.message.content == expected.message.content and got.finish_reason == expected.finish_reason
        expected_logprobs = [e.logprob for e in expected.logprobs.content]
        assert [e.logprob for e in got.logprobs.content] == pytest.approx(expected_logprobs, abs=1e-4)
        assert len(got.logprobs.content) == len(expected.model_extra["token_ids"])


def test_stop_reason_is_null_at_the_models_eos_and_names_a_requested_stop_token(api):
    eos = str(TOKENIZER.eos_token_id)
    ended = api.completions.create(model="tiny", prompt="end", max_tokens=5, logit_bias={eos: 100}).choices[0]
    assert ended.finish_reason == "stop" and ended.model_extra["stop_reason"] is None  # vLLM: None at EOS
    named = api.completions.create(
        model="tiny", prompt="end", max_tokens=5, logit_bias={eos: 100}, extra_body={"stop_token_ids": [int(eos)]}
    ).choices[0]
    assert named.finish_reason == "stop" and named.model_extra["stop_reason"] == int(eos)


def test_later_turns_report_the_prompt_tokens_the_cache_gave(api, zmq_client):
    """A conversation's next turn extends its last prompt: its prompt's full blocks come from the prefix cache, and
    both APIs say how many tokens (OpenAI's usage.prompt_tokens_details.cached_tokens; a Completion's
    cached_prompt_tokens), per prompt once however many samples share it."""
    turn = [(11 * i + 3) % 900 + 4 for i in range(40)]  # 2 full blocks of 16 and some
    settings = dict(model="tiny", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    first = api.completions.create(prompt=turn, **settings)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    later = turn + [5, 6, 7, 8, 9]
    second = api.completions.create(prompt=later, n=2, **settings)
    assert second.usage.prompt_tokens_details.cached_tokens == 32  # the first turn's two full blocks, once
    result = zmq_client.generate(PromptGroup(later + [10], n=2, sampling={"max_new_tokens": 2, "stop_token_ids": []}))
    assert [c.cached_prompt_tokens for c in result.completions] == [32, 32]


def test_a_route_switched_off_answers_404_naming_the_flag_that_serves_it(worker):
    """vLLM's control routes and /tokenizer_info are off by default: their 404 said only "Not Found", like a mistyped
    path; it names the flag now. An unknown path keeps the plain answer."""
    for method, path, flag in (
        ("POST", "/pause", "--enable-control-routes"),
        ("GET", "/server_info", "--enable-control-routes"),
        ("GET", "/tokenizer_info", "--enable-tokenizer-info-endpoint"),
    ):
        answer = httpx.request(method, f"{worker.url}{path}", timeout=30)
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert error["type"] == "not_found_error"
        assert error["message"] == f"{path} is off on this worker: it is served when rollout-worker starts with {flag}"
    metrics = httpx.get(f"{worker.url}/metrics", timeout=30)  # vLLM's place for it: ours is another port
    assert metrics.status_code == 404 and "--metrics-port" in metrics.json()["error"]["message"]
    unknown = httpx.get(f"{worker.url}/no_such_route", timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "Not Found"
