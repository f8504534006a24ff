"""vLLM's control routes on the worker's HTTP API (`--enable-control-routes`), with vLLM's paths, parameters, bodies
and statuses, over the worker's engine manager (`manager.control`, `manager.update_weights`):

- `POST /pause?mode=abort|wait|keep&clear_cache=true`, `POST /resume`, `GET /is_paused`: the generation pause;
- `POST /abort_requests` (`{"request_ids": [...]}`; `{}`, or request_ids null or []: every request, of every client);
- `POST /reset_prefix_cache`; `GET /server_info?config_format=text|json`; `GET /get_world_size`;
- `POST /update_weights` with `{"weight_dir": PATH}`: a checkpoint directory committed as one weight update;
  vLLM's NCCL weight transfer (`update_info`, `/init_weight_transfer_engine`, `/start_weight_update`,
  `/finish_weight_update`) answers 501 naming what is supported, as do vLLM's sleep-mode routes (`/sleep`,
  `/wake_up`, `/is_sleeping`);
- `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter` (adapter_routes.py).

Pause, resume and is_paused answer vLLM's flat bodies (`{"status": "paused"}`, `{"error": "..."}`); a bad parameter
is a 400 in OpenAI's error format naming it (`query.mode`), as vLLM's validation errors are; what a route may be
given beside its parameters is checked in `route_params.py`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response

from rollout.config import WEIGHT_UPDATE_MODES, FieldError
from rollout.engine.manager.continuous_batching import ContinuousBatchingManager
from rollout.engine.manager.generation_pause import GENERATION_PAUSE_MODES, PauseOvertaken
from rollout.service.http.api.live_answers import LiveAnswers
from rollout.service.http.control.adapter_routes import AdapterRoutes
from rollout.service.http.control.allowed_dirs import AllowedDirs
from rollout.service.http.control.checkpoint_dir import read_checkpoint, refused_update
from rollout.service.http.control.route_params import no_body, query_bool, query_choice, query_only
from rollout.service.http.control.server_info import server_info
from rollout.service.http.errors import APIError, SafeJSONResponse, bad_field

logger = logging.getLogger("rollout.worker")

if TYPE_CHECKING:  # the server (serving/) builds the intake and adds these routes: no import back
    from rollout.service.http.serving.bodies import BodyIntake

# vLLM's NCCL weight-transfer routes, answered 501: a trainer calling them fails at once instead of hanging.
NCCL_ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update")
NOT_SUPPORTED = (
    "vLLM's NCCL weight transfer is not supported by rollout-worker: send POST /update_weights with "
    '{"weight_dir": PATH} (a safetensors checkpoint directory the worker can read), or push weights over ZeroMQ '
    "(trainer_bridge.push_weights, which also broadcasts over NCCL)"
)
# vLLM's sleep mode (its dev-mode routes), answered 501: a worker keeps its weights and cache on its device.
SLEEP_ROUTES = {"/sleep": "POST", "/wake_up": "POST", "/is_sleeping": "GET"}
NO_SLEEP = (
    "vLLM's sleep mode is not served by rollout-worker: a worker keeps its weights and KV cache on its device. To "
    'share a GPU with training, run the engine inside the trainer (RolloutGRPOTrainer(..., rollout_mode="colocate", '
    "sleep_between_rounds=True), or ColocatedEngine.sleep())"
)
# The paths these routes serve: they need --control-api-key when one is set (serving/guard.py), and the HTTP metrics
# name them.
CONTROL_PATHS = frozenset(
    {
        "/pause",
        "/resume",
        "/is_paused",
        "/abort_requests",
        "/reset_prefix_cache",
        "/server_info",
        "/get_world_size",
        "/update_weights",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        *NCCL_ROUTES,
        *SLEEP_ROUTES,
    }
)
UPDATE_FIELDS = {"weight_dir", "version", "mode"}


class UpdateListener(Protocol):
    """What the worker is told of the updates /update_weights makes (its ZeroMQ side keeps one account of the
    updates, whichever way they came: `RolloutWorker` is one)."""

    def update_committed(self, directory: str, nbytes: int, pause_ms: float) -> None:
        """A checkpoint's weights are served: the base weights are now named `directory` (adapter pushes made for
        the weights before are refused), `nbytes` of tensors committed, the engine paused `pause_ms` for them."""

    def update_refused(self) -> None:
        """A well-formed update was refused (counted with the ZeroMQ updates refused)."""

    def take_update_turn(self, directory: str) -> str | None:
        """Hold the worker's one weight-update slot for the update from `directory` until `end_update_turn`: None,
        or why it cannot (a ZeroMQ update is open)."""

    def end_update_turn(self) -> None:
        """Free the slot `take_update_turn` held."""


def add_control_routes(
    app: FastAPI,
    manager: ContinuousBatchingManager,
    model_name: str,
    bodies: BodyIntake,
    answers: LiveAnswers,
    allowed: AllowedDirs,
    adapters: AdapterRoutes,
    updates: UpdateListener | None = None,
    check_finite: bool = False,
    model_path: str | None = None,
) -> None:
    """Add the control routes to `app`.

    Args:
        app: the worker's FastAPI application.
        manager: the worker's engine manager.
        model_name: the served model's name.
        model_path: where the model came from (--model as given), for /server_info; None: `model_name`.
        bodies: reads request bodies within the worker's limits.
        answers: the HTTP requests in progress, by their answers' ids (/abort_requests).
        allowed: the directories checkpoints and adapters may be read from.
        adapters: the LoRA routes' state.
        updates: told of each /update_weights committed or refused (`UpdateListener`; None: nobody).
        check_finite: /update_weights refuses a checkpoint holding NaN or Inf (the worker's `--check-finite`).
    """
    control = manager.control
    # One checkpoint read and commit at a time: each queued update would hold a worker thread (the completions
    # routes' threads too) and a whole checkpoint in memory; the next waits here, in the order it came, holding none.
    # The adapter routes' lock: an adapter load (a weight update too) waits its turn beside them, not refused (409).
    one_update = adapters.lock

    @app.post("/pause")
    async def pause(request: Request) -> SafeJSONResponse:
        query_only(request, "mode", "wait_for_inflight_requests", "clear_cache")
        mode = query_choice(request, "mode", "abort", GENERATION_PAUSE_MODES)
        if query_bool(request, "wait_for_inflight_requests", False):  # vLLM's older spelling of mode=wait
            if request.query_params.get("mode", "wait") != "wait":
                reason = f"wait_for_inflight_requests=true means mode=wait, and mode={mode} was given too: drop one"
                raise bad_field("query.wait_for_inflight_requests", reason)
            mode = "wait"
        clear_cache = query_bool(request, "clear_cache", True)
        await no_body(request, bodies, "mode, clear_cache")
        try:
            await control.pause_generation_async(mode, clear_cache)  # holds no thread while "wait" drains
        except PauseOvertaken as error:  # another caller's /resume: a conflict, not a failure
            return SafeJSONResponse({"error": f"Failed to pause generation: {error}"}, status_code=409)
        except (RuntimeError, TimeoutError) as error:
            return SafeJSONResponse({"error": f"Failed to pause generation: {error}"}, status_code=500)
        return SafeJSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume(request: Request) -> SafeJSONResponse:
        query_only(request)
        await no_body(request, bodies, None)
        try:
            await asyncio.to_thread(control.resume_generation)
        except RuntimeError as error:
            return SafeJSONResponse({"error": f"Failed to resume generation: {error}"}, status_code=500)
        return SafeJSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused(request: Request) -> SafeJSONResponse:
        query_only(request)
        return SafeJSONResponse({"is_paused": control.is_paused})

    @app.post("/abort_requests")
    async def abort_requests(request: Request) -> SafeJSONResponse:
        query_only(request)
        needed = 'the body must be a JSON object: {"request_ids": [...]}, or {} for every request'
        if request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers:
            raise APIError(400, needed)  # as vLLM's: no body aborts nothing
        async with bodies.body(request) as body:
            fields = dict(body) if isinstance(body, dict) else None
        if fields is None:
            raise APIError(400, needed)
        for field in fields:
            if field != "request_ids":
                raise bad_field(field, "unknown field (this route takes request_ids)")
        ids = fields.get("request_ids")
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)):
            raise bad_field("request_ids", "must be a list of request ids (strings)")
        if ids:  # as vLLM's: no ids, null or [] abort every request
            found = answers.cancel(ids)
            missing = [request_id for request_id in ids if request_id not in found]
            return SafeJSONResponse({"status": "aborted", "aborted": len(found), "not_found": missing})
        count = await asyncio.to_thread(control.abort_all)
        return SafeJSONResponse({"status": "aborted", "aborted": count, "not_found": []})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> SafeJSONResponse:
        query_only(request, "reset_running_requests", "reset_external")
        await no_body(request, bodies, "reset_running_requests, reset_external")
        reset_running = query_bool(request, "reset_running_requests", False)
        if query_bool(request, "reset_external", False):
            raise bad_field("query.reset_external", "this worker has no external KV cache connector")
        # As vLLM's: true has the running samples compute their KV again (under the weights served now).
        return SafeJSONResponse({"success": await asyncio.to_thread(control.reset_prefix_cache, reset_running)})

    @app.get("/server_info")
    async def get_server_info(request: Request) -> SafeJSONResponse:
        query_only(request, "config_format")
        config_format = query_choice(request, "config_format", "text", ("text", "json"))
        return SafeJSONResponse(server_info(manager, model_name, config_format, model_path))

    @app.get("/get_world_size")
    async def get_world_size(request: Request) -> SafeJSONResponse:
        query_only(request, "include_dp")
        query_bool(request, "include_dp", True)  # one process, no data parallelism: 1 either way
        return SafeJSONResponse({"world_size": 1})

    @app.post("/update_weights")
    async def update_weights(request: Request) -> SafeJSONResponse:
        query_only(request)
        async with bodies.body(request) as body:
            fields = dict(body) if isinstance(body, dict) else None
        if fields is None:
            raise APIError(400, "the body must be a JSON object", None)
        if "update_info" in fields:
            raise APIError(501, f"update_info: {NOT_SUPPORTED}", "update_info", "not_implemented_error")
        for field in fields:
            if field not in UPDATE_FIELDS:
                raise bad_field(field, f"unknown field (this route takes {sorted(UPDATE_FIELDS)})")
        try:  # a well-formed request for an update: its refusal is counted and logged as a ZeroMQ update's is
            directory = allowed.directory(fields.get("weight_dir"), "weight_dir")
            mode = fields.get("mode", "keep")
            if mode not in WEIGHT_UPDATE_MODES:
                raise bad_field("mode", f"must be one of {list(WEIGHT_UPDATE_MODES)}, got {mode!r}")
            async with one_update:
                busy = updates.take_update_turn(str(directory)) if updates is not None else None
                if busy is not None:
                    raise APIError(409, busy, None, "conflict_error", "update_in_progress")
                try:
                    result, nbytes = await asyncio.to_thread(
                        _update_from, manager, allowed, fields["weight_dir"], fields.get("version"), mode, check_finite
                    )
                finally:
                    if updates is not None:
                        updates.end_update_turn()
        except APIError as refused:
            if updates is not None:
                updates.update_refused()
            logger.warning("weight update refused (POST /update_weights): %r", refused.message[:300])
            raise
        if updates is not None:
            updates.update_committed(str(directory), nbytes, result.pause_ms)
        return SafeJSONResponse(
            {
                "message": "Weights updated",
                "policy_version": result.version,
                "pause_ms": result.pause_ms,
                "aborted": result.aborted,
                "recomputed": result.recomputed,
            }
        )

    for path in NCCL_ROUTES:
        app.add_api_route(path, _not_supported, methods=["POST"])
    for path, method in SLEEP_ROUTES.items():
        app.add_api_route(path, _no_sleep, methods=[method])

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        query_only(request)
        async with bodies.body(request) as body:
            fields = body
        return await adapters.load(fields)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        query_only(request)
        async with bodies.body(request) as body:
            fields = body
        return await adapters.unload(fields)


async def _not_supported() -> SafeJSONResponse:
    raise APIError(501, NOT_SUPPORTED, None, "not_implemented_error")


async def _no_sleep() -> SafeJSONResponse:
    raise APIError(501, NO_SLEEP, None, "not_implemented_error")


def _update_from(
    manager: ContinuousBatchingManager,
    allowed: AllowedDirs,
    weight_dir: str,
    version: Any,
    mode: str,
    check_finite: bool,
) -> tuple[Any, int]:
    """Read the checkpoint at `weight_dir` and commit it as one weight update (a worker thread: reading takes a
    while); logged as the ZeroMQ updates are. Returns the update's result and its tensors' bytes (as served: cast).
    The directory is checked again here, right before it is read: the route's own check came before its wait for
    the update before it, long enough for a link to be put in its place."""
    directory = allowed.directory(weight_dir, "weight_dir")
    tensors = read_checkpoint(directory, manager.engine.weight_table.specs(), check_finite)
    nbytes = sum(tensor.nbytes for tensor in tensors.values())
    logger.info("weight update from %r (POST /update_weights): %d tensors, mode %s", str(directory), len(tensors), mode)
    try:
        result = manager.update_weights(tensors, version=version, mode=mode)
        logger.info(
            "weight update from %r committed: version %d, pause %.1f ms",
            str(directory),
            result.version,
            result.pause_ms,
        )
        return result, nbytes
    except FieldError as error:
        if error.field in ("version", "mode"):
            raise bad_field(error.field, error.reason) from None
        raise refused_update(error, directory) from None
    except TimeoutError as error:
        raise APIError(503, f"the weight update was not applied: {error}", None, "service_unavailable_error") from None
