"""The HTTP front end's refusals that need particular worker settings (an API key, a small body limit, a full queue,
no tokenizer), on in-process servers over one engine manager whose loop never runs: every request here is answered
before it would reach the engine."""

from __future__ import annotations

import time

import httpx2 as httpx  # the HTTP library the openai client is built on
import openai
import pytest

from rollout import GroupSpec
from rollout.config import ContinuousBatchingConfig
from rollout.engine.manager.continuous_batching import init_continuous_batching
from rollout.presets import tiny_model, tiny_tokenizer
from rollout.service.http.serving.server import HttpServer
from rollout.service.http.serving.settings import HttpSettings

KEY = "secret-key"


@pytest.fixture(scope="module")
def manager():
    config = ContinuousBatchingConfig(num_blocks=64, block_size=16, max_queue_size=1)
    manager = init_continuous_batching(tiny_model(), continuous_batching_config=config, tokenizer=tiny_tokenizer())
    manager.add_groups([GroupSpec("fills-the-queue", [5, 6, 7])])  # never taken: the engine thread is not started
    yield manager
    manager.stop()


def serve(manager, tokenizer, api_key=None):
    settings = HttpSettings(max_n=8, max_prompt_len=2048, max_body_bytes=4096, api_key=api_key)
    return HttpServer(manager, tokenizer, settings).start()


@pytest.fixture(scope="module")
def server(manager):
    http = serve(manager, tiny_tokenizer(), KEY)
    yield http
    http.stop()


def test_a_full_queue_answers_503_busy(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as client:
        with pytest.raises(openai.InternalServerError) as raised:
            client.completions.create(model="tiny", prompt="hello")
    assert raised.value.status_code == 503 and raised.value.body["code"] == "busy"
    assert raised.value.body["message"] == (
        "queue full: max_queue_size=1 requests are already waiting; retry later (the worker's --max-queue-size)"
    )


def test_a_batch_larger_than_the_queue_is_a_400_naming_the_prompt(server):
    # A batch of more prompts than --max-queue-size could never be queued: "busy, retry later" would be retried
    # forever (and its "1 requests are already waiting" is not why).
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model="tiny", prompt=["hello", "there"])
    assert raised.value.status_code == 400 and raised.value.body["param"] == "prompt"
    assert "2 prompts" in raised.value.body["message"] and "--max-queue-size" in raised.value.body["message"]


def test_the_api_key_is_required_except_for_health(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    assert httpx.get(f"{server.url}/health").status_code == 503  # open to probes; the engine is not running
    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert models.json()["data"][0]["id"] == "tiny"


def test_a_body_over_the_limit_is_a_413(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x" * 5000}, headers=headers)
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(10):
            yield b" " * 1000

    headers["Content-Type"] = "application/json"
    response = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=headers)
    assert response.status_code == 413


def test_a_body_over_the_client_budget_alone_is_a_413_not_a_retry_later(manager):
    # A body whose parsed values alone take more than one client may hold: "429, wait for this client's other
    # requests" (it had none) would be retried forever.
    settings = HttpSettings(max_n=8, max_prompt_len=2048, max_body_bytes=4096, max_receiving_bytes_per_client=4096)
    http = HttpServer(manager, tiny_tokenizer(), settings).start()
    try:
        response = httpx.post(f"{http.url}/v1/completions", json={"prompt": [5] * 1000})
        assert response.status_code == 413, response.text
        assert "--http-max-receiving-bytes-per-client" in response.json()["error"]["message"]
    finally:
        http.stop()


def test_text_endpoints_without_a_tokenizer_say_so(manager):
    http = serve(manager, None)
    try:
        for path, body in (("/v1/completions", {"prompt": [5, 6]}), ("/tokenize", {"prompt": "x"})):
            response = httpx.post(f"{http.url}{path}", json=body)
            assert response.status_code == 400 and "tokenizer" in response.json()["error"]["message"]
    finally:
        http.stop()


def test_a_body_still_arriving_when_the_server_stops_is_answered_503(manager):
    """SIGTERM while a client was half-way through its body: the read held the shutdown for its grace period, then
    was cancelled, and uvicorn printed a 60-line CancelledError traceback. The client is told to send it again."""
    import socket

    http = serve(manager, tiny_tokenizer())
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{http.port}\r\nContent-Type: application/json\r\n"
        "Content-Length: 4000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", http.port), timeout=30) as client:
        client.sendall(head.encode() + b'{"prompt": "' + b"a" * 100)
        time.sleep(0.5)  # the body's first bytes are being read
        http.stop()
        answer = client.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 503"), answer
    assert "the worker is stopping: send the request again" in answer


def test_models_report_the_context_the_kv_cache_holds_when_it_is_less_than_the_models(server, manager):
    """64 blocks of 16 tokens hold 1,024 tokens (a sample's last token is never fed back: 1,025 in all), less than the
    model's 2,048: /v1/models and /tokenize said 2,048, and clients that size prompts by it (lm-eval) were refused."""
    assert manager.engine.max_model_len == 2048
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as client:
        assert [model.model_extra["max_model_len"] for model in client.models.list()] == [1025]
        with pytest.raises(openai.BadRequestError) as raised:  # the longest prompt it takes: 1,024 tokens
            client.completions.create(model="tiny", prompt=[5] * 1025, max_tokens=1)
    assert raised.value.body["code"] == "context_length_exceeded"
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
    assert tokens.json()["max_model_len"] == 1025


def test_an_unexpected_error_is_a_500_in_openais_error_shape(server, monkeypatch):
    """A bug's 500 was a bare text "Internal Server Error", which the openai client could not read an error from."""
    from rollout.service.http.serving import app

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app, "model_list", broken)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as client:
        with pytest.raises(openai.InternalServerError) as raised:
            client.models.list()
    assert raised.value.status_code == 500
    assert raised.value.body["message"] == "internal error serving /v1/models: RuntimeError: a bug"
    assert raised.value.body["type"] == "internal_server_error"
