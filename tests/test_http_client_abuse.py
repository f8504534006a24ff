"""A careless client against `rollout-worker --http`, with raw httpx: what it gets back must be what vLLM's server
(FastAPI's own error handling) would send, in OpenAI's error shape."""

from __future__ import annotations

import httpx2 as httpx  # the HTTP library the openai client is built on
import pytest


@pytest.mark.parametrize(
    "method, path, allowed",
    [("GET", "/v1/completions", {"POST"}), ("PUT", "/v1/chat/completions", {"POST"}), ("POST", "/health", None)],
)
def test_a_method_the_route_does_not_take_is_a_405_that_says_which_it_does(http_worker, method, path, allowed):
    """RFC 9110 (15.5.6): a 405 must carry `Allow`, as Starlette raises it and FastAPI's handler (vLLM's) sends it;
    the body is OpenAI's error shape. (The OpenAI-shaped handler dropped the header.)"""
    response = httpx.request(method, f"{http_worker.url}{path}", timeout=30)
    assert response.status_code == 405
    assert response.json()["error"]["message"] == "Method Not Allowed"
    methods = {m.strip() for m in response.headers["allow"].split(",")}
    assert methods == allowed if allowed is not None else {"GET", "HEAD"} <= methods


@pytest.mark.parametrize(
    "path, field, body",
    [
        ("/v1/completions", "x" * 2_000_000, {"prompt": "x"}),  # an unknown field, named in message and param
        ("/v1/completions", "model", {"prompt": "x", "model": "m" * 2_000_000}),  # a 404
        (
            "/v1/chat/completions",
            "tool_choice",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "c" * 2_000_000},
        ),
    ],
)
def test_an_error_quotes_a_huge_value_in_part(http_worker, path, field, body):
    """An error names the field and quotes what was sent, as SamplingParams' errors do, in part (`'aaa...aaa'`): a
    2 MB field name or value came back whole, twice for a field name (message and param), a reply twice the body's
    size encoded on the event loop that streams every answer."""
    body = {**body, field: body.get(field, 1)}
    response = httpx.post(f"{http_worker.url}{path}", json=body, timeout=60)
    assert response.status_code in (400, 404) and len(response.content) < 10_000, len(response.content)
    error = response.json()["error"]
    assert error["param"][:100] == field[:100] and field[:100] in error["message"]
