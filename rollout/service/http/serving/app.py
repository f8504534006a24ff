"""The FastAPI application of `rollout-worker --http`: OpenAI's /v1/completions, /v1/chat/completions and
/v1/models (and /v1/models/{id}), vLLM's /tokenize and /detokenize (and /tokenizer_info with --enable-tokenizer-info-endpoint), and /health,
over the worker's engine manager; vLLM's control routes with --enable-control-routes (`rollout.service.http.control`).

Errors are OpenAI-format bodies (errors.py): 400 naming the field, 401 without the worker's --api-key, 404 for
another model name or path, 408/413/415 for a body too slow, too big or not JSON, 503 `busy` when the queue is full.
Parsing, chat templates, tokenization and detokenization run on worker threads, off the event loop that streams
every answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from rollout.engine.manager.continuous_batching import ContinuousBatchingManager
from rollout.service.compile.constraint_compiles import ConstraintCompiles
from rollout.service.group_counters import GroupCounters
from rollout.service.http.api.answers import Answer
from rollout.service.http.api.bridge import ClientGone
from rollout.service.http.api.constraint_wait import client_address
from rollout.service.http.api.endpoints import OpenAIEndpoints
from rollout.service.http.api.live_answers import LiveAnswers
from rollout.service.http.api.served_models import model_entry, model_list
from rollout.service.http.api.tokenize import TokenizeEndpoints
from rollout.service.http.api.tokenizer_info import tokenizer_info
from rollout.service.http.control.adapter_routes import AdapterRoutes
from rollout.service.http.control.allowed_dirs import AllowedDirs
from rollout.service.http.control.routes import CONTROL_PATHS, UpdateListener, add_control_routes
from rollout.service.http.errors import APIError, SafeJSONResponse
from rollout.service.http.serving.bodies import BodyIntake, ReceiveBudget
from rollout.service.http.serving.guard import RequestGuard
from rollout.service.http.serving.settings import HttpSettings

# The paths the API serves (what the HTTP metrics name; any other path is reported as "other").
ENDPOINTS = frozenset(
    {"/health", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/tokenizer_info"}
    | CONTROL_PATHS
)


def build_app(
    manager: ContinuousBatchingManager,
    tokenizer: Any,
    settings: HttpSettings,
    counters: GroupCounters | None = None,
    compiles: ConstraintCompiles | None = None,
    updates: UpdateListener | None = None,
) -> FastAPI:
    """The application.

    Args:
        manager: the worker's engine manager (started by the worker; shared with its ZeroMQ socket).
        tokenizer: the worker's tokenizer (None: text endpoints answer 400).
        settings: the served model's name, limits, API key and trust (`HttpSettings`).
        counters: the worker's group counters (HTTP groups count as ZeroMQ ones do); None: a fresh set.
        compiles: the worker's structured-output compile slots (its ZeroMQ clients take turns with HTTP ones);
            None: the app's own.
        updates: told of each /update_weights committed or refused (`UpdateListener`; None: nobody).
    """
    counters = GroupCounters() if counters is None else counters
    app = FastAPI(
        title="rollout", docs_url=None, redoc_url=None, openapi_url=None, default_response_class=SafeJSONResponse
    )
    model_name = settings.model_name
    budget = ReceiveBudget(settings.max_receiving_bytes, settings.max_receiving_bytes_per_client)
    bodies = BodyIntake(settings.max_body_bytes, budget)
    endpoints = OpenAIEndpoints(
        manager,
        model_name,
        tokenizer,
        settings.max_n,
        settings.max_prompt_len,
        settings.max_answer_logprobs,
        settings.trust_request_chat_template,
        counters,
        settings.tool_call_parser,
        compiles,
        model_defaults=settings.generation_config == "auto",
    )

    def close() -> None:  # what the server calls once it stopped: the compile and parse threads
        endpoints.close()
        bodies.close()

    app.state.close = close
    app.state.stop_reading = bodies.stop_reading  # the server stopping: bodies still arriving are answered 503
    engine = manager.engine
    tokens = TokenizeEndpoints(
        tokenizer, model_name, engine.vocab_size, engine.max_model_len, endpoints.limits, engine.runner.adapters.refs
    )

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> SafeJSONResponse:
        headers = {"Connection": "close"} if error.close_connection else None
        return SafeJSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> SafeJSONResponse:
        # A bug's 500 in OpenAI's error shape (clients read error.message; a bare text body failed their parsing),
        # naming the route and the exception's type; Starlette logs the traceback after this answer.
        message = f"internal error serving {request.url.path}: {type(error).__name__}: {error}"
        return SafeJSONResponse(APIError(500, message, None, "internal_server_error").body(), status_code=500)

    # Routes this worker would serve with a flag: their 404 names it (a bare "Not Found" read like a wrong path).
    switched_off = {} if settings.enable_control_routes else dict.fromkeys(CONTROL_PATHS, "--enable-control-routes")
    if not settings.enable_tokenizer_info_endpoint:
        switched_off["/tokenizer_info"] = "--enable-tokenizer-info-endpoint"

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> SafeJSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = str(error.detail)
        flag = switched_off.get(request.url.path) if error.status_code == 404 else None
        if flag is not None:
            message = f"{request.url.path} is off on this worker: it is served when rollout-worker starts with {flag}"
        elif error.status_code == 404 and request.url.path == "/metrics":  # vLLM serves it on its API's port
            message = "/metrics is not on the API's port: rollout-worker serves Prometheus metrics on --metrics-port"
        body = APIError(error.status_code, message, None, kind).body()
        return SafeJSONResponse(body, error.status_code, headers=error.headers)  # a 405's Allow (RFC 9110)

    app.add_middleware(
        RequestGuard,
        api_key=settings.api_key,
        loopback_only=settings.loopback_only,
        control_api_key=settings.control_api_key,
        control_paths=CONTROL_PATHS,
    )
    live = LiveAnswers()
    adapters = AdapterRoutes(manager, AllowedDirs(settings.control_allowed_dirs), updates)
    if settings.enable_control_routes:
        add_control_routes(
            app,
            manager,
            model_name,
            bodies,
            live,
            adapters.allowed,
            adapters,
            updates,
            settings.check_finite,
            model_path=settings.model_path,
        )

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> SafeJSONResponse:
        if not manager.is_running():
            return SafeJSONResponse({"status": "stopped"}, status_code=503)
        return SafeJSONResponse({"status": "ok", "policy_version": manager.engine.policy_version})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        engine = manager.engine
        refs = engine.runner.adapters.refs
        # (what the KV cache holds when less than the model's context: clients size their prompts by it)
        return model_list(model_name, endpoints.context_len, engine.policy_version, refs, adapters.roots())

    @app.get("/v1/models/{model_id:path}")  # OpenAI's retrieve (an id may hold slashes: "Qwen/Qwen3-0.6B")
    async def model(model_id: str) -> dict[str, Any]:
        return model_entry(model_id, await models())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool) -> Any:
        loop = asyncio.get_running_loop()
        try:  # parsing, tokenizing and checking are slow work (worker threads); a constraint compiles on its own
            async with bodies.body(request) as body:
                # Each caller's address takes its own admission turns (as its constraint compiles do).
                answer = await asyncio.to_thread(endpoints.prepare, body, chat, f"http {client_address(request)}")
                del body  # the parsed body leaves the budget: nothing may hold it after (the answer keeps its own)
            await endpoints.compile(answer, request)
        except APIError:
            counters.group_refused()
            raise

        def start() -> Answer:  # a worker thread: adding a batch of groups checks every prompt
            answer.start(loop)
            return answer

        starting = asyncio.ensure_future(asyncio.to_thread(start))
        try:
            await asyncio.shield(starting)
        except APIError:
            counters.group_refused()
            raise
        except asyncio.CancelledError:  # the client left while its groups were being added: cancel them once added
            starting.add_done_callback(_cancel_started)
            raise
        live.add(answer)
        if answer.request.stream:
            return StreamingResponse(_streamed(answer), media_type="text/event-stream")
        try:
            return Response(
                await endpoints.answers.complete(answer, request.is_disconnected), media_type="application/json"
            )
        finally:
            live.remove(answer)
            answer.submission.cancel()

    async def _streamed(answer: Answer) -> AsyncIterator[str]:
        try:
            async for event in endpoints.answers.stream(answer):
                yield event
        finally:
            live.remove(answer)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        async with bodies.body(request) as body:
            ids = await asyncio.to_thread(tokens.tokenize, body)
        return {"count": len(ids), "max_model_len": endpoints.context_len, "tokens": ids}

    if settings.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> dict[str, Any]:
            return tokenizer_info(tokenizer)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        async with bodies.body(request) as body:
            return {"prompt": await asyncio.to_thread(tokens.detokenize, body)}

    return app


def _cancel_started(starting: asyncio.Future) -> None:
    """Cancel the groups of a request whose client left before they were all added."""
    if not starting.cancelled() and starting.exception() is None:
        starting.result().submission.cancel()
