"""The FastAPI application of `rollout-worker --http`: OpenAI's /v1/completions, /v1/chat/completions and
/v1/models, vLLM's /tokenize and /detokenize, and /health, over the worker's engine manager.

Errors are OpenAI-format bodies (errors.py): 400 naming the field, 401 without the worker's --api-key, 404 for
another model name or path, 408/413/415 for a body too slow, too big or not JSON, 503 `busy` when the queue is full.
Parsing, chat templates and tokenization run on worker threads, off the event loop that streams every answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from rollout.engine.manager import ContinuousBatchingManager
from rollout.service.http.bridge import ClientGone
from rollout.service.http.endpoints import OpenAIEndpoints
from rollout.service.http.errors import APIError, bad_field
from rollout.service.http.guard import RequestGuard, read_body
from rollout.service.http.prompts import chat_prompt, needs_tokenizer
from rollout.service.http.settings import HttpSettings

TOKENIZE_FIELDS = {
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "tools",
    "chat_template_kwargs",
    "continue_final_message",
}
CHAT_ONLY_FIELDS = TOKENIZE_FIELDS - {"model", "prompt", "messages", "add_special_tokens"}


def build_app(manager: ContinuousBatchingManager, tokenizer: Any, settings: HttpSettings) -> FastAPI:
    """The application.

    Args:
        manager: the worker's engine manager (started by the worker; shared with its ZeroMQ socket).
        tokenizer: the worker's tokenizer (None: text endpoints answer 400).
        settings: the served model's name, limits, API key and trust (`HttpSettings`).
    """
    app = FastAPI(title="rollout", docs_url=None, redoc_url=None, openapi_url=None)
    model_name, max_body_bytes = settings.model_name, settings.max_body_bytes
    endpoints = OpenAIEndpoints(
        manager,
        model_name,
        tokenizer,
        settings.max_n,
        settings.max_prompt_len,
        settings.trust_request_chat_template,
    )

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(error.status_code, str(error.detail), None, kind).body(), error.status_code)

    app.add_middleware(RequestGuard, api_key=settings.api_key, loopback_only=settings.loopback_only)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it

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
        raw = await read_body(request, max_body_bytes)
        answer = await asyncio.to_thread(lambda: endpoints.prepare(_parse(raw), chat))
        answer.start()  # on the event loop: the groups' outputs come back to it
        if answer.request.stream:
            return StreamingResponse(endpoints.stream(answer), media_type="text/event-stream")
        try:
            return await endpoints.complete(answer, request.is_disconnected)
        finally:
            answer.submission.cancel()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        raw = await read_body(request, max_body_bytes)
        ids = await asyncio.to_thread(lambda: _tokenize(_parse(raw)))
        return {"count": len(ids), "max_model_len": manager.engine.max_model_len, "tokens": ids}

    def _tokenize(body: Any) -> list[int]:
        _check_request(body, "/tokenize")
        if "messages" in body:
            extra = sorted({"prompt", "add_special_tokens"} & set(body))
            if extra:
                raise bad_field(extra[0], "not used with messages (the chat template decides special tokens)")
            return chat_prompt(body, tokenizer, endpoints.limits)
        extra = sorted(CHAT_ONLY_FIELDS & set(body))
        if extra:
            raise bad_field(extra[0], "only used with messages")
        prompt, add_special = body.get("prompt"), body.get("add_special_tokens", True)
        if not isinstance(prompt, str):
            raise bad_field("prompt", "give a string prompt, or messages")
        if not isinstance(add_special, bool):
            raise bad_field("add_special_tokens", "must be a boolean")
        if len(prompt) > endpoints.limits.max_chars:
            raise bad_field("prompt", f"over {endpoints.limits.max_chars} characters")
        try:
            return list(tokenizer(prompt, add_special_tokens=add_special)["input_ids"])
        except Exception as error:  # noqa: BLE001 - text the tokenizer cannot take
            raise bad_field("prompt", f"the tokenizer cannot encode it: {type(error).__name__}") from None

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = _parse(await read_body(request, max_body_bytes))
        _check_request(body, "/detokenize", {"model", "tokens"})
        tokens = body.get("tokens")
        vocab = manager.engine.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise bad_field("tokens", f"must be a list of token ids in [0, {vocab})")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, tokens)}

    def _check_request(body: Any, path: str, known: set[str] = TOKENIZE_FIELDS) -> None:
        needs_tokenizer(tokenizer, path)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        unknown = sorted(set(body) - known)
        if unknown:
            raise bad_field(unknown[0], "unknown field")
        if body.get("model") not in (None, model_name):
            raise APIError(
                404, f"the model `{body['model']}` does not exist", "model", "not_found_error", "model_not_found"
            )

    return app


def _parse(raw: bytes) -> Any:
    """A JSON body (400 when it is not JSON, or nested too deeply to parse)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise APIError(400, f"the request body is not valid JSON: {type(error).__name__}: {error}"[:500]) from None
