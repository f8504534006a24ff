"""`rollout-worker`'s flags for the OpenAI-compatible HTTP API: the address (`--http`), its limits on request bodies,
connections and answers, chat templates and tool calls, and the generation key (`--api-key`). The control routes'
flags are `rollout.service.http.control.flags`."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from rollout.service.http.control.flags import key_refusal
from rollout.service.http.serving.settings import (
    DEFAULT_MAX_ANSWER_LOGPROBS,
    GENERATION_CONFIG_MODES,
    HEAD_TIMEOUT_S,
    KEEP_ALIVE_TIMEOUT_S,
    MAX_WAITING_CONNECTIONS,
    TOOL_CALL_PARSER_NAMES,
)

# The environment variable --api-key's default is read from (as every flag's from its ROLLOUT_* one; it keeps the key
# out of `ps`).
API_KEY_VARIABLE = "ROLLOUT_API_KEY"


def add_http_arguments(add: Callable[..., Any]) -> None:
    """Add the flags (`add`: the parser's `add_argument`)."""
    add(
        "--http",
        default=None,
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
        "/tokenize, /detokenize, /health) on this address, over the same engine (needs pip install 'rollout[http]'; "
        "port 0 picks a free one; default: off)",
    )
    add(
        "--generation-config",
        choices=GENERATION_CONFIG_MODES,
        default="auto",
        help="where an HTTP request's left-out temperature, top_p, top_k, min_p and repetition_penalty come from: "
        "auto, the model's generation_config.json where it sets them (as vLLM's default), else OpenAI's defaults; "
        "vllm, OpenAI's defaults alone (temperature 1, no truncation) (default: auto)",
    )
    add(
        "--http-max-body-bytes",
        type=int,
        default=16 << 20,
        help="largest HTTP request body in bytes, at least 1024; larger ones are answered 413 (default: 16 MiB)",
    )
    add(
        "--http-max-receiving-bytes",
        type=int,
        default=None,
        help="most bytes of HTTP request bodies held at once (being received or parsed: a body's bytes plus 40 per "
        "JSON value and 32 more per string, what they take once parsed) for all clients; past it a request is "
        "answered 503 (default: twice the per-client share)",
    )
    add(
        "--http-max-receiving-bytes-per-client",
        type=int,
        default=None,
        help="the same for one client address; past it, 429 (default: what the largest body may take, about 180 "
        "MB; behind a proxy every client has the proxy's address: raise it)",
    )
    add(
        "--http-max-answer-logprobs",
        type=int,
        default=DEFAULT_MAX_ANSWER_LOGPROBS,
        help="most log-prob entries a whole (not streamed) answer may hold; a request that could exceed it is "
        "answered 400 before it starts",
    )
    add(
        "--http-head-timeout",
        type=float,
        default=HEAD_TIMEOUT_S,
        help="seconds an HTTP connection may take to send a complete request head; slower ones are closed",
    )
    add(
        "--http-keep-alive-timeout",
        type=float,
        default=KEEP_ALIVE_TIMEOUT_S,
        help="seconds an idle HTTP keep-alive connection stays open",
    )
    add(
        "--http-max-waiting-connections",
        type=int,
        default=MAX_WAITING_CONNECTIONS,
        help="most new HTTP connections that have not sent their first request head; past it the one that waited "
        "longest is closed (connections with a request in progress, or kept alive between requests, never count)",
    )
    add(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSER_NAMES,
        default=None,
        help="read tool calls out of chat answers in this format (hermes: Qwen/Hermes <tool_call>{json}</tool_call>; "
        "llama3_json: Llama 3.1/3.2 JSON) into message.tool_calls; without it, chat requests that ask for tool "
        "calls are refused (default: none)",
    )
    add(
        "--trust-request-chat-template",
        action="store_true",
        help="let HTTP requests bring their own chat template (vLLM's top-level chat_template field, or "
        "chat_template_kwargs.chat_template): a template is code the worker runs, so only when every client is "
        "trusted",
    )
    add(
        "--api-key",
        default=None,
        help="HTTP clients must send Authorization: Bearer <key> (every path but /health); a non-loopback --http "
        "needs it or --insecure (default: the ROLLOUT_API_KEY environment variable, which keeps the key out of ps)",
    )


def check_http_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, str]:
    """--http's HOST:PORT and the HTTP limits checked, each a usage error naming its flag; needs nothing imported, so
    `rollout-worker` runs it before torch loads (and again, with the rest, in `check_http_address`).

    Args:
        parser: rollout-worker's parser.
        args: the parsed flags (with --http given).
    Returns:
        (host, port) as given, the host without IPv6 brackets.
    """
    host, _, port = args.http.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        parser.error(f"--http {args.http}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    host = host.strip("[]")
    if args.http_max_body_bytes < 1024:
        parser.error(f"--http-max-body-bytes {args.http_max_body_bytes}: must be at least 1024")
    if args.api_key == "":
        parser.error(f"--api-key (or {API_KEY_VARIABLE}): must not be empty")
    if args.api_key is not None and key_refusal(args.api_key) is not None:
        parser.error(f"--api-key (or {API_KEY_VARIABLE}): {key_refusal(args.api_key)}")
    for flag, value in (
        ("--http-head-timeout", args.http_head_timeout),
        ("--http-keep-alive-timeout", args.http_keep_alive_timeout),
    ):
        if not (math.isfinite(value) and value > 0):
            parser.error(f"{flag} {value}: must be a number of seconds > 0")
    for flag, value in (
        ("--http-max-receiving-bytes-per-client", args.http_max_receiving_bytes_per_client),
        ("--http-max-receiving-bytes", args.http_max_receiving_bytes),
    ):
        if value is not None and value < args.http_max_body_bytes:
            parser.error(f"{flag} {value}: must be at least --http-max-body-bytes ({args.http_max_body_bytes})")
    total, per_client = args.http_max_receiving_bytes, args.http_max_receiving_bytes_per_client
    if total is not None and per_client is not None and total < per_client:
        parser.error(f"--http-max-receiving-bytes {total}: must be at least --http-max-receiving-bytes-per-client")
    if args.http_max_answer_logprobs < 1:
        parser.error(f"--http-max-answer-logprobs {args.http_max_answer_logprobs}: must be at least 1")
    if args.http_max_waiting_connections < 1:
        parser.error(f"--http-max-waiting-connections {args.http_max_waiting_connections}: must be at least 1")
    return host, port
