"""Structured-output compiles over HTTP: in turn between client addresses and within the compile budget. A grammar
that takes ~20 s to compile on the tiny vocabulary is refused with a 400 naming its field at the budget, while
another address's json_object and schema requests, and the same address's plain ones, are served at once; a client
that disconnects abandons its compile; constraints no sample can follow are a 400 naming the field, not a 500."""

from __future__ import annotations

import threading
import time

import httpx2 as httpx
import pytest

pytest.importorskip("xgrammar")

from test_compile_slots import SLOW, _children  # noqa: E402

from rollout.config import ContinuousBatchingConfig  # noqa: E402
from rollout.engine.manager.continuous_batching import init_continuous_batching  # noqa: E402
from rollout.presets import tiny_model, tiny_tokenizer  # noqa: E402
from rollout.service.compile.constraint_compiles import ConstraintCompiles  # noqa: E402
from rollout.service.compile.jobs import CompileBudget  # noqa: E402
from rollout.service.http.serving.server import HttpServer  # noqa: E402
from rollout.service.http.serving.settings import HttpSettings  # noqa: E402

BUDGET_S = 2.0


@pytest.fixture(scope="module")
def server():
    tokenizer = tiny_tokenizer()
    config = ContinuousBatchingConfig(num_blocks=64, block_size=16)
    manager = init_continuous_batching(tiny_model(0), continuous_batching_config=config, tokenizer=tokenizer).start()
    compiles = ConstraintCompiles(manager.engine.intake, CompileBudget(max_seconds=BUDGET_S))
    compiles.start()
    deadline = time.monotonic() + 120
    while compiles.link._state != "ready":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    http = HttpServer(manager, tokenizer, HttpSettings(max_n=8, max_prompt_len=1024), compiles=compiles).start()
    http.compiles = compiles
    yield http
    http.stop()
    compiles.close()
    manager.stop()


def client(address: str) -> httpx.Client:
    """An HTTP client whose connections come from `address` (a loopback address of its own: another client)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=60)


def complete(http: httpx.Client, server, **body) -> httpx.Response:
    return http.post(f"{server.url}/v1/completions", json={"prompt": "go", "max_tokens": 8, **body})


def test_a_slow_grammar_is_refused_by_name_while_other_requests_are_served(server):
    attacker, other = client("127.0.0.1"), client("127.0.0.2")
    refused = {}
    start = time.monotonic()
    slow = threading.Thread(
        target=lambda: refused.update(response=complete(attacker, server, structured_outputs={"grammar": SLOW}))
    )
    slow.start()
    time.sleep(0.3)  # compiling now
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}}
    format_ = {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}
    for body in ({"response_format": {"type": "json_object"}}, {"response_format": format_}, {}):
        asked = time.monotonic()
        response = complete(other if body else attacker, server, **body)  # (a plain request: the attacker's own)
        assert response.status_code == 200 and time.monotonic() - asked < 1.5, (body, response.text)
    slow.join(30)
    response = refused["response"]
    assert response.status_code == 400 and BUDGET_S <= time.monotonic() - start < BUDGET_S + 3
    error = response.json()["error"]
    assert error["param"] == "structured_outputs.grammar"
    assert error["message"] == (
        f"structured_outputs.grammar: did not compile within {BUDGET_S:g} s (this worker's --max-compile-s)"
    )


def test_a_client_that_leaves_abandons_its_compile(server):
    leaving, outcome = client("127.0.0.3"), []
    body = {"prompt": "go", "structured_outputs": {"grammar": SLOW + " "}}

    def post() -> None:
        try:
            leaving.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
        except httpx.TimeoutException as error:  # the client gives up and closes its connection
            outcome.append(error)

    gone = threading.Thread(target=post)
    gone.start()
    deadline = time.monotonic() + 1
    while server.compiles.num_active == 0:
        assert time.monotonic() < deadline, "the compile never started"
        time.sleep(0.02)
    compiling = _children(server.compiles.link.pid)
    gone.join(5)
    assert outcome
    leaving.close()
    deadline = time.monotonic() + 1.0  # (well before the budget would end it)
    while server.compiles.num_active:
        assert time.monotonic() < deadline, "the compile outlived its client"
        time.sleep(0.02)
    assert compiling - _children(server.compiles.link.pid)  # its compile process was killed


@pytest.mark.parametrize(
    ("body", "param", "reason"),
    [
        ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs.regex", "allows no token at the first"),
        ({"structured_outputs": {"regex": "\u20ac"}}, "structured_outputs.regex", "allows no token at the first"),
        ({"structured_outputs": {"choice": ["a"]}, "min_tokens": 3}, "structured_outputs.choice", "min_tokens=3"),
        ({"structured_outputs": {"regex": "[a-z]+"}, "min_tokens": 3}, None, None),  # followed: admitted
    ],
)
def test_a_constraint_no_sample_can_follow_is_a_400_naming_its_field(server, body, param, reason):
    response = complete(client("127.0.0.1"), server, **body)
    if param is None:
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"][0]["text"]) >= 3
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and reason in error["message"], error
