"""`rollout-worker`'s flags for the OpenAI-compatible HTTP API: the address (`--http`), its limits on request bodies,
connections and answers, chat templates and tool calls, and the generation key (`--api-key`). The control routes'
flags are `rollout.service.http.control.flags`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.service.http.serving.settings import (
    DEFAULT_MAX_ANSWER_LOGPROBS,
    HEAD_TIMEOUT_S,
    KEEP_ALIVE_TIMEOUT_S,
    MAX_WAITING_CONNECTIONS,
    TOOL_CALL_PARSER_NAMES,
)


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
        help="let HTTP requests bring their own chat template (chat_template_kwargs.chat_template): a template is "
        "code the worker runs, so only when every client is trusted",
    )
    add(
        "--api-key",
        default=None,
        help="HTTP clients must send Authorization: Bearer <key> (every path but /health); a non-loopback --http "
        "needs it or --insecure (default: the ROLLOUT_API_KEY environment variable, which keeps the key out of ps)",
    )
