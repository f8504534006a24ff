"""`HttpSettings`: how the worker's HTTP front end serves (`rollout-worker --http ...` flags), validated."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rollout.config import FieldError
from rollout.protocol.sockets import is_loopback
from rollout.service.http.control.flags import key_refusal

DEFAULT_MAX_BODY_BYTES = 16 << 20
# Most JSON arrays and objects in one body (an upper bound: brackets inside strings count too, so a long prompt of
# code or JSON text may hold many): a batch of 1,024 token-id prompts, messages with content parts and 128 tools hold
# a few thousand; parsing 262,144 empty lists takes about 0.13 s.
MAX_BODY_CONTAINERS = 1 << 18
# Most values in one body (commas, an upper bound): a batch of 1,024 prompts of 2,000 token ids holds two million;
# parsing three million numbers or short strings takes about 0.35 s.
MAX_BODY_ELEMENTS = 3_000_000
# Most strings in one body (half its double quotes, an upper bound): a short string costs 60 bytes once parsed, twelve
# times its bytes in the body.
MAX_BODY_STRINGS = 1 << 20
# What a body's values may cost once parsed, in bytes, beyond its own bytes: each value's pointer and a number object
# (or a list's), and each string's object. The receive budget holds a body's bytes plus these.
PARSED_BYTES_PER_VALUE = 40
PARSED_BYTES_PER_STRING = 32
# Log-prob entries of a whole answer: each costs about 400 bytes of memory while the answer is built, so 2^19 bound
# one answer to about 200 MB (a 2,000-token prompt's 20 top log-probs echoed into 128 choices are 5.4 million).
DEFAULT_MAX_ANSWER_LOGPROBS = 1 << 19
# The tool-call formats --tool-call-parser reads (rollout.service.http.tools.tool_calls.TOOL_CALL_PARSERS).
TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json")
# Seconds a connection may take to send a complete request head, from when it connected (or its last answer ended).
HEAD_TIMEOUT_S = 10.0
# Seconds an idle keep-alive connection stays open after its last answer (uvicorn's timeout_keep_alive).
KEEP_ALIVE_TIMEOUT_S = 5.0
# New connections that have not sent their first request head; past it the one that waited longest is closed.
MAX_WAITING_CONNECTIONS = 256


# Where a request's left-out sampling fields come from (`HttpSettings.generation_config`, vLLM's --generation-config
# values without a folder): the model's generation config, or OpenAI's defaults alone.
GENERATION_CONFIG_MODES = ("auto", "vllm")


@dataclass(frozen=True)
class HttpSettings:
    """The HTTP front end's settings.

    Attributes:
        host: address to listen on (a loopback address answers only loopback Host headers).
        port: TCP port (0 picks a free one).
        model_name: the name /v1/models reports and requests' `model` must match.
        model_path: where the model came from (--model as given), reported by /server_info as vLLM reports its
            path; None: `model_name`.
        max_n: most samples per request (`n` times the number of prompts).
        max_prompt_len: longest prompt, in tokens.
        max_body_bytes: largest request body (larger ones are answered 413).
        max_receiving_bytes: most bytes of request bodies the worker holds at once, being received or parsed (each
            body's bytes plus what its values may take once parsed), for all clients (past it a request is
            answered 503; None: twice max_receiving_bytes_per_client).
        max_receiving_bytes_per_client: the same for one client address (past it, 429; None: what the largest body
            may take, `largest_body_bytes`). Behind a proxy every client has the proxy's address: raise it.
        max_answer_logprobs: most log-prob entries a whole (not streamed) answer may hold: its choices' prompt and
            completion log-probs, each with its top alternatives (a request that could exceed it is answered 400
            before it starts; streamed answers are never held whole).
        api_key: every path but /health needs `Authorization: Bearer <api_key>` (None: no key).
        trust_request_chat_template: requests may bring their own chat template (code the worker runs).
        head_timeout_s: seconds a connection may take to send a complete request head (then it is closed).
        keep_alive_timeout_s: seconds an idle keep-alive connection stays open after its last answer.
        max_waiting_connections: most new connections that have not sent their first request head (past it the one
            that waited longest is closed); connections with a request in progress, or kept alive between requests,
            are never counted.
        tool_call_parser: how chat answers' tool calls are read ("hermes" or "llama3_json"; None: chat requests
            that ask for tool calls are refused).
        enable_control_routes: serve vLLM's control routes (pause, resume, abort, prefix cache reset, server facts,
            weight updates from a directory, LoRA adapters by path).
        enable_tokenizer_info_endpoint: serve vLLM's GET /tokenizer_info (the tokenizer's settings and template).
        control_api_key: the key the control routes need (None: they need `api_key`, as every route).
        control_allowed_dirs: the directories /update_weights and /v1/load_lora_adapter may read (none: neither
            reads anything).
        check_finite: /update_weights refuses a checkpoint holding NaN or Inf (the worker's `--check-finite`).
        generation_config: "auto": a request that leaves temperature, top_p, top_k, min_p or repetition_penalty out
            takes the model's generation config's value where it sets one (vLLM's default); "vllm": OpenAI's
            defaults (temperature 1, no truncation), whatever the model's config says.
    """

    host: str = "127.0.0.1"
    port: int = 0
    model_name: str = "tiny"
    model_path: str | None = None
    max_n: int = 1024
    max_prompt_len: int = 1 << 20
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_receiving_bytes: int | None = None
    max_receiving_bytes_per_client: int | None = None
    max_answer_logprobs: int = DEFAULT_MAX_ANSWER_LOGPROBS
    api_key: str | None = None
    trust_request_chat_template: bool = False
    head_timeout_s: float = HEAD_TIMEOUT_S
    keep_alive_timeout_s: float = KEEP_ALIVE_TIMEOUT_S
    max_waiting_connections: int = MAX_WAITING_CONNECTIONS
    tool_call_parser: str | None = None
    enable_control_routes: bool = False
    enable_tokenizer_info_endpoint: bool = False
    control_api_key: str | None = None
    control_allowed_dirs: tuple[str, ...] = ()
    check_finite: bool = False
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if self.generation_config not in GENERATION_CONFIG_MODES:
            reason = f"must be one of {list(GENERATION_CONFIG_MODES)}, got {self.generation_config!r}"
            raise FieldError("generation_config", reason)
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise FieldError("port", f"must be in [0, 65535], got {self.port!r}")
        for name in ("max_n", "max_prompt_len", "max_waiting_connections", "max_answer_logprobs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise FieldError(name, f"must be an integer >= 1, got {value!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise FieldError("max_body_bytes", f"must be at least 1024, got {self.max_body_bytes!r}")
        # Defaults follow max_body_bytes (a client's share never over the total); each holds at least one body.
        body, total, per_client = self.max_body_bytes, self.max_receiving_bytes, self.max_receiving_bytes_per_client
        if per_client is None:
            per_client = self.largest_body_bytes if total is None else min(self.largest_body_bytes, total)
        if total is None:
            total = 2 * per_client
        for name, value, least, what in (
            ("max_receiving_bytes_per_client", per_client, body, "max_body_bytes"),
            ("max_receiving_bytes", total, per_client, "max_receiving_bytes_per_client"),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise FieldError(name, f"must be an integer >= {what} ({least}), got {value!r}")
            object.__setattr__(self, name, value)
        for name in ("head_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise FieldError(name, f"must be a number of seconds > 0, got {value!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSER_NAMES:
            raise FieldError(
                "tool_call_parser", f"must be one of {TOOL_CALL_PARSER_NAMES}, got {self.tool_call_parser!r}"
            )
        for name in ("api_key", "control_api_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise FieldError(name, "must be a non-empty string")
            if value is not None and key_refusal(value) is not None:
                raise FieldError(name, key_refusal(value))
        for name in ("enable_control_routes", "enable_tokenizer_info_endpoint", "check_finite"):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(name, f"must be a bool, got {getattr(self, name)!r}")
        dirs = self.control_allowed_dirs
        if not isinstance(dirs, tuple) or not all(isinstance(d, str) and d for d in dirs):
            raise FieldError("control_allowed_dirs", f"must be a tuple of directory paths, got {dirs!r}")

    @property
    def largest_body_bytes(self) -> int:
        """What the largest body may hold in the receive budget: its bytes and its most values, parsed."""
        values = PARSED_BYTES_PER_VALUE * (MAX_BODY_ELEMENTS + MAX_BODY_CONTAINERS)
        return self.max_body_bytes + values + PARSED_BYTES_PER_STRING * MAX_BODY_STRINGS

    @property
    def loopback_only(self) -> bool:
        """The server listens on loopback only (then it answers only loopback Host headers)."""
        return is_loopback(f"tcp://{self.host}:{self.port}")
