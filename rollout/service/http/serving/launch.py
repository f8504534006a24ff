"""`rollout-worker --http HOST:PORT [--api-key KEY]`: the flags checked before the model loads, and the HTTP
front end started beside the ZeroMQ socket. Imports FastAPI and uvicorn only when the front end starts."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollout.cli.extras import MissingExtra, require_extra
from rollout.engine.manager.continuous_batching import ContinuousBatchingManager
from rollout.protocol.sockets import is_loopback
from rollout.service.address_checks import check_bind
from rollout.service.http.control.flags import check_control_flags
from rollout.service.http.serving.flags import API_KEY_VARIABLE, check_http_flags
from rollout.service.http.serving.settings import HttpSettings
from rollout.service.zmq.limits import WorkerLimits

if TYPE_CHECKING:
    from rollout.service.http.serving.server import HttpServer
    from rollout.service.zmq.worker import RolloutWorker

logger = logging.getLogger("rollout.worker")
# The environment variable the HTTP API key is read from when --api-key is not given.


def check_http_address(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, int] | None:
    """(host, port) of --http, checked before the model loads (None without it). The key may come from the
    ROLLOUT_API_KEY environment variable (as every flag may from its ROLLOUT_* variable), which keeps it out of `ps`."""
    check_control_flags(parser, args)
    if args.http is None:
        if args.api_key is not None:
            given = f"{API_KEY_VARIABLE} (--api-key)" if os.environ.get(API_KEY_VARIABLE) else "--api-key"
            parser.error(f"{given} protects the HTTP API: give --http HOST:PORT too, or unset it")
        return None
    host, port = check_http_flags(parser, args)
    try:  # FastAPI and uvicorn load only once the model has; their absence is found now
        require_extra("http", f"--http {args.http}")
    except MissingExtra as error:
        parser.error(str(error))
    if not is_loopback(f"tcp://{host}:{port}") and args.api_key is None:
        if not args.insecure:
            parser.error(
                f"--http {args.http}: a non-loopback address needs --api-key or {API_KEY_VARIABLE} (or --insecure "
                "to accept anyone)"
            )
        logger.warning("--insecure: the HTTP API at %s answers anyone who can reach it, without a key", args.http)
    if int(port):
        check_bind(parser, f"tcp://{host}:{port}", flag="--http", shown=args.http)
    return host, int(port)


def start_http(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    address: tuple[str, int],
    manager: ContinuousBatchingManager,
    worker: RolloutWorker,
    tokenizer: Any,
    limits: WorkerLimits,
    observe: Callable[[str, int, float], None] | None = None,
) -> HttpServer:
    """Start the HTTP front end on the worker's manager (a usage error when FastAPI/uvicorn are missing or it
    cannot listen).

    Args:
        parser, args: rollout-worker's parser and arguments.
        address: (host, port) from `check_http_address`.
        manager, worker, tokenizer, limits: what the worker serves, and its limits.
        observe: records each HTTP request in the worker's metrics (None: no --metrics-port).
    """
    from rollout.service.http.serving.server import HttpServer

    try:
        settings = HttpSettings(
            host=address[0],
            port=address[1],
            model_name=worker.model_name,  # --served-model-name, else --model
            model_path=args.model,
            max_n=limits.max_n,
            max_prompt_len=worker.max_prompt_len,
            max_body_bytes=args.http_max_body_bytes,
            max_receiving_bytes=args.http_max_receiving_bytes,
            max_receiving_bytes_per_client=args.http_max_receiving_bytes_per_client,
            max_answer_logprobs=args.http_max_answer_logprobs,
            api_key=args.api_key,
            trust_request_chat_template=args.trust_request_chat_template,
            head_timeout_s=args.http_head_timeout,
            keep_alive_timeout_s=args.http_keep_alive_timeout,
            max_waiting_connections=args.http_max_waiting_connections,
            tool_call_parser=args.tool_call_parser,
            enable_control_routes=args.enable_control_routes,
            enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
            control_api_key=args.control_api_key,
            control_allowed_dirs=tuple(args.control_allowed_dirs),
            check_finite=args.check_finite,
            generation_config=args.generation_config,
        )
        http = HttpServer(
            manager,
            tokenizer,
            settings,
            worker.counters,
            observe,
            worker.compiles,
            worker,
        )
        http.start()
    except (ImportError, RuntimeError, ValueError) as error:
        parser.error(f"--http {args.http}: {error}")
    # The attribute prompts.py reads (not imported from there: it loads starlette, and this module loads without it).
    no_template = tokenizer is not None and getattr(tokenizer, "chat_template", None) is None
    if no_template and not args.trust_request_chat_template:
        logger.warning(
            "--http: the tokenizer of %s has no chat template, so /v1/chat/completions answers 400: pass --tokenizer "
            "naming one that has (the instruct model's), or send rendered prompts to /v1/completions",
            args.tokenizer or args.model,
        )
    logger.info("OpenAI-compatible API at %s/v1", http.url)
    if settings.enable_control_routes:
        logger.info("vLLM's control routes at %s (/pause, /resume, /update_weights, ...)", http.url)
    return http
