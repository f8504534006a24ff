"""The FastAPI application of `rollout-worker --http`: OpenAI's /v1/completions, /v1/chat/completions and
/v1/models, vLLM's /tokenize and /detokenize, and /health, over the worker's engine manager.

Errors are OpenAI-format bodies (errors.py): 400 naming the field, 401 without the worker's --api-key, 404 for
another model name or path, 413 for a body over the limit, 503 `busy` when the queue is full.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from rollout.engine.manager import ContinuousBatchingManager
from rollout.service.http.bridge import ClientGone
from rollout.service.http.endpoints import OpenAIEndpoints
from rollout.service.http.errors import APIError, bad_field
from rollout.service.http.prompts import chat_prompt, needs_tokenizer

# Paths anyone may call without the API key (load balancers probe them).
OPEN_PATHS = ("/health",)


def build_app(
    manager: ContinuousBatchingManager,
    model_name: str,
    tokenizer: Any,
    max_n: int,
    max_prompt_len: int,
    max_body_bytes: int,
    api_key: str | None = None,
) -> FastAPI:
    """The application.

    Args:
        manager: the worker's engine manager (started by the worker; shared with its ZeroMQ socket).
        model_name: the name /v1/models reports and `model` fields must match.
        tokenizer: the worker's tokenizer (None: text endpoints answer 400).
        max_n: most samples per prompt.
        max_prompt_len: longest prompt, in tokens.
        max_body_bytes: largest request body (a larger one is answered 413).
        api_key: when set, every path but /health needs `Authorization: Bearer <api_key>`.
    """
    app = FastAPI(title="rollout", docs_url=None, redoc_url=None, openapi_url=None)
    endpoints = OpenAIEndpoints(manager, model_name, tokenizer, max_n, max_prompt_len)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(error.status_code, str(error.detail), None, kind).body(), error.status_code)

    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not manager.is_running():
            return JSONResponse({"status": "stopped"}, status_code=503)
        return JSONResponse({"status": "ok", "policy_version": manager.engine.policy_version})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "rollout",
                    "root": model_name,
                    "max_model_len": manager.engine.max_model_len,
                    "policy_version": manager.engine.policy_version,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool) -> Any:
        answer = endpoints.prepare(await _json(request, max_body_bytes), chat)
        if answer.request.stream:
            return StreamingResponse(endpoints.stream(answer), media_type="text/event-stream")
        try:
            return await endpoints.complete(answer, request.is_disconnected)
        except ClientGone:
            return JSONResponse({}, status_code=499)  # nobody reads it: the groups were cancelled
        finally:
            answer.submission.cancel()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await _json(request, max_body_bytes)
        needs_tokenizer(tokenizer, "/tokenize")
        _only(
            body,
            {
                "model",
                "prompt",
                "messages",
                "add_special_tokens",
                "add_generation_prompt",
                "tools",
                "chat_template_kwargs",
                "continue_final_message",
            },
        )
        if "messages" in body:
            ids = chat_prompt(body, tokenizer)
        elif isinstance(body.get("prompt"), str):
            add_special = body.get("add_special_tokens", True)
            if not isinstance(add_special, bool):
                raise bad_field("add_special_tokens", "must be a boolean")
            ids = list(tokenizer(body["prompt"], add_special_tokens=add_special)["input_ids"])
        else:
            raise bad_field("prompt", "give a string prompt, or messages")
        return {"count": len(ids), "max_model_len": manager.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await _json(request, max_body_bytes)
        needs_tokenizer(tokenizer, "/detokenize")
        _only(body, {"model", "tokens"})
        tokens = body.get("tokens")
        vocab = manager.engine.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise bad_field("tokens", f"must be a list of token ids in [0, {vocab})")
        return {"prompt": tokenizer.decode(tokens)}

    return app


class ApiKeyCheck:
    """Pure ASGI middleware answering 401 to requests without `Authorization: Bearer <api_key>` (but /health).
    Not Starlette's BaseHTTPMiddleware: that wraps `receive`, and a handler then no longer sees its client leave."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            if dict(scope["headers"]).get(b"authorization") != self.expected:
                message = "a valid API key is required (Authorization: Bearer ...)"
                error = APIError(401, message, None, "authentication_error")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _json(request: Request, limit: int) -> Any:
    """The request's JSON body, read no further than `limit` bytes (413 past it, 400 when it is not JSON)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes; this worker takes at most {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is over {limit} bytes, the most this worker takes")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None


def _only(body: Any, known: set[str]) -> None:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_field(unknown[0], "unknown field")
