"""No client can stall or starve another: attacks on a real worker (its HTTP API and its ZeroMQ socket over one
engine), each run while /health is probed every 20 ms and a ZeroMQ trainer streams a long group beside it, with the
thresholds: no probe waits over 1 s, the trainer's stream never pauses over 1 s, the worker's RSS grows at most
300 MB, and every refusal names its limit."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import threading
import time

import httpx2 as httpx  # the HTTP library the openai client is built on
import pytest

from rollout.config import SamplingParams
from rollout.service.http.api.answer_size import MAX_ANSWER_TOKENS, check_answer_size
from rollout.service.http.api.openai_fields import GenerationRequest
from rollout.service.http.api.prompts import MAX_TOOLS
from rollout.service.http.api.template_inputs import MAX_TEMPLATE_VARIABLES
from rollout.service.http.errors import APIError
from rollout.service.http.serving.bodies import ReceiveBudget
from rollout.service.http.serving.settings import MAX_BODY_CONTAINERS, MAX_BODY_ELEMENTS, MAX_BODY_STRINGS, HttpSettings
from service_helpers import Worker, free_port
from serving_watch import watches

KEY = "isolation-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
MESSAGES = [{"role": "user", "content": "hi"}]
BODY_LIMIT = 16 << 20
COMPILE_BUDGET_S = 2.0
# Tokens a step may take: the longest pause of a stream beside a big prefill is one step (about 0.2 s for 256 tokens
# of the tiny model on this CPU, 1-2 s for the default 2048), whatever the size of the batch that is prefilled.
STEP_TOKENS = 256
# A grammar that takes about 20 s to compile on the tiny vocabulary (2.8 KB).
SLOW_GRAMMAR = "root ::= " + " ".join("[a-z]? [0-9]?" for _ in range(200))


@pytest.fixture(scope="module")
def worker():
    port, metrics_port = free_port(), free_port()
    os.environ["ROLLOUT_API_KEY"] = KEY
    try:
        server = Worker(
            "--http",
            f"127.0.0.1:{port}",
            "--http-max-body-bytes",
            str(BODY_LIMIT),
            "--metrics-port",
            str(metrics_port),
            "--max-compile-s",
            str(COMPILE_BUDGET_S),
            "--max-batch-tokens",
            str(STEP_TOKENS),
        )
    finally:
        del os.environ["ROLLOUT_API_KEY"]
    server.url, server.port = f"http://127.0.0.1:{port}", port
    server.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield server
    server.close()


@pytest.fixture
def watch(worker):
    """Starts watching the other clients (`serving_watch.watches`)."""
    with watches(worker) as start:
        yield start


@pytest.fixture(scope="module")
def http(worker):
    with httpx.Client(base_url=worker.url, headers=HEADERS, timeout=120) as client:
        yield client


def error_of(response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


def sent_together(http, path: str, raw: bytes, count: int) -> list:
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda _: http.post(path, content=raw), range(count)))


def test_bodies_of_millions_of_containers_are_refused_while_they_arrive(worker, http, watch):
    # An unknown field holding five million empty lists: 15 MB, seconds of parsing under the interpreter lock.
    raw = b'{"prompt": "hi", "junk": [' + b",".join([b"[]"] * 5_000_000) + b"]}"
    watch = watch()
    for response in sent_together(http, "/v1/completions", raw, 4):
        assert f"over {MAX_BODY_CONTAINERS} JSON arrays and objects" in error_of(response, 413)
    watch.check()


@pytest.mark.parametrize("value", [b"0", b"1e300", b'"ab"'])
def test_the_largest_legal_bodies_are_parsed_one_at_a_time(worker, http, watch, value):
    # Four bodies of as many values as one may hold (three million numbers, a million strings, or 16 MB; `1e300` is slow for some JSON
    # parsers, and short strings take 12 times their bytes once parsed) are parsed one at a time, within the budget.
    most = MAX_BODY_STRINGS - 10 if value.startswith(b'"') else MAX_BODY_ELEMENTS - 10
    count = min(most, (BODY_LIMIT - 100) // (len(value) + 1))
    raw = b'{"prompt": "hi", "max_tokens": 1, "junk": [' + b",".join([value] * count) + b"]}"
    watch = watch()
    for response in sent_together(http, "/v1/completions", raw, 4):
        if response.status_code == 429:  # one address holds what one such body may take at once
            assert "per client address" in error_of(response, 429)
        else:
            assert "junk: unknown field" in error_of(response, 400, "junk")
    watch.check()


def test_a_code_prompt_full_of_brackets_is_not_refused_for_its_shape(http):
    response = http.post("/v1/completions", json={"prompt": "x = [[{}]]; " * 22_000, "max_tokens": 1})
    assert "tokens" in error_of(response, 400, "prompt")  # too long for the tiny model, but read and tokenized


@pytest.mark.parametrize(
    "field, value",
    [
        ("chat_template_kwargs", {f"v{index}": "x" for index in range(200_000)}),
        ("tools", [{"type": "function", "function": {"name": f"f{index}"}} for index in range(20_000)]),
    ],
)
def test_many_template_variables_or_tools_are_refused_by_name(worker, http, field, value, watch):
    limit = MAX_TEMPLATE_VARIABLES if field == "chat_template_kwargs" else MAX_TOOLS
    body = {"messages": MESSAGES, "max_tokens": 1, field: value, "tool_choice": "none"}
    watch = watch()
    assert f"at most {limit}" in error_of(http.post("/v1/chat/completions", json=body), 400, field)
    watch.check()
    if field == "chat_template_kwargs":  # (128 tools render to more tokens than the tiny model's context)
        at_limit = dict(list(value.items())[:limit])
        response = http.post("/v1/chat/completions", json={**body, field: at_limit})
        assert response.status_code == 200, response.text


def upload_and_stall(port: int, size: int, sockets: list[socket.socket]) -> None:
    """A connection that announces a `size`-byte body, sends all but its last kilobyte and stops."""
    connection = socket.create_connection(("127.0.0.1", port))
    sockets.append(connection)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    )
    try:
        connection.sendall(head.encode() + b'{"prompt": "' + b"a" * (size - 1000))
    except OSError:
        pass  # answered 429 and closed: what the worker holds is what counts


def answered(worker, status: int) -> float:
    """/v1/completions requests the worker answered with `status` so far (its metrics)."""
    line = f'rollout_http_requests_total{{endpoint="/v1/completions",status="{status}"}} '
    text = httpx.get(worker.metrics_url).text
    return sum(float(row[len(line) :]) for row in text.splitlines() if row.startswith(line))


def test_stalled_uploads_hold_a_bounded_number_of_bytes(worker, http, watch):
    refused_before = answered(worker, 429)
    watch = watch()
    sockets: list[socket.socket] = []
    size, count = 15_000_000, 60
    uploads = [threading.Thread(target=upload_and_stall, args=(worker.port, size, sockets)) for _ in range(count)]
    try:
        for upload in uploads:
            upload.start()
        for upload in uploads:
            upload.join(30)
        watch.check()  # (the RSS threshold: 60 uploads of 15 MB would hold 900 MB)
        # One address may hold what the largest body may take: the uploads past it were answered 429.
        most_held = HttpSettings(max_body_bytes=BODY_LIMIT).max_receiving_bytes_per_client // size
        deadline = time.monotonic() + 15  # on a loaded machine the last refusals are counted after the joins
        while answered(worker, 429) - refused_before < count - most_held and time.monotonic() < deadline:
            time.sleep(0.2)
        assert answered(worker, 429) - refused_before >= count - most_held
    finally:
        for connection in sockets:
            connection.close()
    deadline = time.monotonic() + 10  # the worker sees the closed connections and gives their bytes back
    while time.monotonic() < deadline:
        if http.post("/v1/completions", json={"prompt": "a" * 8_000_000}).status_code == 400:  # read, not 429
            break
        time.sleep(0.2)
    else:
        pytest.fail("the bytes of closed uploads were not given back")


def test_a_body_refused_while_it_arrives_closes_its_connection(worker):
    """A refusal before the body was read whole (429 past the address's share) says `Connection: close`: the rest of
    the body is never read, so the connection cannot carry another request. A keep-alive client then opens a new
    connection for its next request; before, that request was lost ("Server disconnected without sending a
    response")."""
    raw = b'{"prompt": [' + b",".join([b"1"] * 2_900_000) + b"]}"  # 5.8 MB, about 120 MB once parsed
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    )
    stalled = socket.create_connection(("127.0.0.1", worker.port))  # holds half of the address's share
    try:
        stalled.sendall(head.encode() + raw[: len(raw) // 2])
        time.sleep(1.0)
        with httpx.Client(base_url=worker.url, headers=HEADERS, timeout=60) as client:
            for _ in range(4):
                response = client.post("/v1/completions", content=raw)
                assert "per client address" in error_of(response, 429)
                assert response.headers["connection"] == "close"
    finally:
        stalled.close()


def test_an_answer_that_would_copy_prompt_logprobs_into_every_choice_is_refused(worker, http, watch):
    body = {"prompt": [7] * 2000, "prompt_logprobs": 20, "echo": True, "logprobs": 20, "n": 128, "max_tokens": 1}
    start_watch, watch = watch, watch()
    start = time.monotonic()
    message = error_of(http.post("/v1/completions", json=body), 400)
    assert "--http-max-answer-logprobs" in message and "stream it" in message
    assert time.monotonic() - start < 1.0
    watch.check()
    # The largest whole answer allowed (half a million entries, 13 MB) is built and encoded without a stall (a
    # shorter prompt in more choices: fewer prompt log-probs to compute).
    watch = start_watch()
    largest = {**body, "prompt": [7] * 500, "n": 48}
    del largest["prompt_logprobs"]
    answer = http.post("/v1/completions", json=largest).json()
    assert [len(choice["logprobs"]["top_logprobs"]) for choice in answer["choices"]] == [501] * 48
    watch.check()
    # Streamed, it is sent as it is made: allowed (a smaller one here, to keep the test short).
    streamed = {**body, "n": 4, "stream": True}
    with httpx.stream("POST", f"{worker.url}/v1/completions", json=streamed, headers=HEADERS, timeout=120) as reply:
        assert reply.status_code == 200
        assert sum(1 for line in reply.iter_lines() if '"prompt_logprobs"' in line) == 4


def test_n_past_the_workers_limit_is_refused_by_name(http):
    message = error_of(http.post("/v1/completions", json={"prompt": "hi", "n": 1025}), 400, "n")
    assert "1024" in message


def test_a_batch_of_two_million_prompt_tokens_pauses_other_streams_one_step_and_ends_with_its_client(worker, watch):
    """1,024 valid prompts of 2,000 tokens (about half an hour of prefill here) are admitted; while they prefill, the
    trainer streaming beside them pauses no longer than one step of the token budget (the 1 s threshold). When the
    client's connection closes, the batch is cancelled: a request sent after it is answered at once, not after it."""
    watching = watch()
    body = json.dumps({"prompt": [[7 + index % 50] * 2000 for index in range(1024)], "max_tokens": 1}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {HEADERS['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", worker.port)) as impatient:
        impatient.sendall(head + body)
        deadline = time.monotonic() + 60
        while worker.stats()["running"] < 2:  # the batch is checked, queued and prefilling beside the stream
            assert time.monotonic() < deadline, worker.stats()
            time.sleep(0.05)
        time.sleep(2.0)  # a few steps of the batch's prefill, under the watch
    started = time.monotonic()
    with httpx.Client(base_url=worker.url, headers=HEADERS, timeout=60) as client:
        answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 200 and time.monotonic() - started < 10, answer.text[:300]
    watching.check()


def test_every_attack_leaves_ordinary_requests_served(http):
    answer = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
    assert len(answer["choices"]) == 1 and answer["usage"]["completion_tokens"] == 2


def test_the_receive_budget_holds_a_share_per_address_and_a_total():
    budget = ReceiveBudget(total_bytes=100, per_client_bytes=40)
    budget.reserve("a", 30)
    with pytest.raises(APIError) as refused:
        budget.reserve("a", 20)
    assert refused.value.status == 429 and "at most 40 per client address" in refused.value.body()["error"]["message"]
    budget.reserve("b", 40)
    budget.reserve("c", 30)
    with pytest.raises(APIError) as full:
        budget.reserve("d", 1)
    assert full.value.status == 503 and budget.held == 100  # nothing was held for the refused ones
    for client, size in (("a", 30), ("b", 40), ("c", 30)):
        budget.release(client, size)
    assert budget.held == 0 and not budget.by_client


@pytest.mark.parametrize("chat, field", [(False, "max_tokens"), (True, "max_completion_tokens")])
def test_a_whole_answer_of_more_tokens_than_the_bound_is_refused_before_it_starts(chat, field):
    # n at the default --max-n, each choice at a 32k context's max_tokens: 33 million tokens held whole.
    request = GenerationRequest([[1, 2, 3]], SamplingParams(max_new_tokens=32_768), n=1024)
    with pytest.raises(APIError) as refused:
        check_answer_size(request, chat, limit=1 << 19)
    assert refused.value.param == field and f"at most {MAX_ANSWER_TOKENS}" in str(refused.value.body())
    check_answer_size(GenerationRequest([[1, 2, 3]], SamplingParams(max_new_tokens=32_768), n=64), chat, 1 << 19)
    streamed = GenerationRequest([[1, 2, 3]], SamplingParams(max_new_tokens=32_768), n=1024, stream=True)
    check_answer_size(streamed, chat, 1 << 19)  # sent as it is made: never held whole


def test_slow_grammars_from_two_clients_starve_no_one(worker, watch):
    """Two clients' grammars that would each hold a compile process for 20 s are refused by name at the budget,
    while a third client's json_object request and the other clients are served at once."""
    pytest.importorskip("xgrammar")
    clients = [
        httpx.Client(base_url=worker.url, headers=HEADERS, timeout=60, transport=httpx.HTTPTransport(local_address=a))
        for a in ("127.0.0.1", "127.0.0.3", "127.0.0.2")
    ]
    body = {"prompt": "go", "max_tokens": 4}
    try:
        assert clients[2].post("/v1/completions", json=body).status_code == 200  # (the compile server is up)
        watch = watch()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            slow = [
                pool.submit(
                    client.post, "/v1/completions", json={**body, "structured_outputs": {"grammar": SLOW_GRAMMAR}}
                )
                for client in clients[:2]
            ]
            time.sleep(0.5)  # both compiling now
            asked = time.monotonic()
            served = clients[2].post("/v1/completions", json={**body, "response_format": {"type": "json_object"}})
            assert served.status_code == 200 and time.monotonic() - asked < 1.0, served.text
            for refused in slow:
                message = error_of(refused.result(), 400, "structured_outputs.grammar")
                assert f"did not compile within {COMPILE_BUDGET_S:g} s" in message
        watch.check()
    finally:
        for client in clients:
            client.close()


def test_a_turn_of_the_serving_loop_ends_after_its_time_budget():
    """Fifty queued messages that each cost 4 ms: one turn of the serving loop reads only those that fit its
    RECEIVE_TURN_S (10 ms) and leaves the rest for the next turn, after replies went out and clients were watched
    (before, a turn read up to 1000 messages: one client's costly burst held back every other client's replies)."""
    from types import SimpleNamespace

    from rollout.service.zmq.worker import RECEIVE_TURN_S, RolloutWorker

    worker = object.__new__(RolloutWorker)  # only the turn's own parts: reader, links, dispatch
    queued = [SimpleNamespace(identity=b"flood", frames=[b"x"], refused=None) for _ in range(50)]
    worker._reader = SimpleNamespace(read=lambda: queued.pop(0) if queued else None, busy=False)
    worker._auth = None  # no keys: a message's key is not read
    worker._links = SimpleNamespace(seen=lambda identity, fd, key: None)
    handled = []
    worker._receive = lambda identity, frames, key: time.sleep(0.004) or handled.append(identity)
    worker._receive_all()
    assert 1 <= len(handled) <= RECEIVE_TURN_S / 0.004 + 1 and len(queued) == 50 - len(handled)
