"""Errors of the HTTP front end in OpenAI's format: `{"error": {"message", "type", "param", "code"}}` with the HTTP
status a client's SDK maps to its exception classes (400 BadRequestError, 404 NotFoundError, 413, 503 ...)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.responses import JSONResponse

from rollout.config import FieldError

# The engine's and SamplingParams' names -> the OpenAI / vLLM request field a client set.
OPENAI_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "prompt_ids": "prompt",
    "stop_token_ids": "stop_token_ids",
    "return_routes": "return_routed_experts",
}
# Most characters of an error's message and param: what a client sent is quoted in part (a 16 MB field name or model
# name came back whole, twice for a field name, in a reply encoded on the event loop that streams every answer).
MAX_MESSAGE_CHARS = 2000
MAX_PARAM_CHARS = 256


@dataclass
class APIError(Exception):
    """An HTTP error reply.

    Attributes:
        status: HTTP status code.
        message: what was wrong, for a person.
        param: the request field at fault (None: the request as a whole).
        type: OpenAI's error type ("invalid_request_error", "not_found_error", ...).
        code: a short machine-readable code ("model_not_found", "busy", ...), or None.
        close_connection: the reply says `Connection: close` (the request's body was not read whole: the connection
            cannot carry another request, and a keep-alive client must not send one over it).
    """

    status: int
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    code: str | None = None
    close_connection: bool = False

    def body(self) -> dict[str, Any]:
        """The JSON body of the reply (message and param clipped in their middle: `clip`)."""
        message, param = clip(self.message, MAX_MESSAGE_CHARS), self.param and clip(self.param, MAX_PARAM_CHARS)
        return {"error": {"message": message, "type": self.type, "param": param, "code": self.code}}


def clip(text: str, most: int) -> str:
    """`text`, or its beginning and end around "..." when it is longer than `most` characters.

    Args:
        text: an error's text.
        most: the most characters kept.
    """
    if len(text) <= most:
        return text
    half = (most - 3) // 2
    return f"{text[:half]}...{text[len(text) - half :]}"


def bad_field(param: str, reason: str) -> APIError:
    """A 400 naming the request field `param`."""
    return APIError(400, f"{param}: {reason}", param)


def from_field_error(error: FieldError, prompt_field: str = "prompt") -> APIError:
    """A 400 for a FieldError raised by SamplingParams or the engine's intake, under the client's name of the field
    (`prompt_field`: "prompt" or "messages", where the prompt came from)."""
    names = {**OPENAI_NAMES, "prompt_ids": prompt_field}
    param = names.get(error.field, error.field)
    return bad_field(param, error.reason)


def busy(reason: str) -> APIError:
    """A 503: the worker's queue is full; retry later. The engine's own "queue full" (its `max_queue_size`) names
    the worker's flag that sets it too, as an operator reads a client's error.

    Args:
        reason: why (the engine's QueueFullError message, or the worker stopping).
    """
    if reason.startswith("queue full: max_queue_size="):
        reason += "; retry later (the worker's --max-queue-size)"
    return APIError(503, reason, None, "service_unavailable_error", "busy")


class SafeJSONResponse(JSONResponse):
    """Starlette's JSONResponse, that also renders text which is not valid Unicode: a lone surrogate (`"\\ud800"`,
    which JSON allows) in a request field an error message quotes, or in a model's tool-call arguments, is sent
    escaped (`\\ud800`) instead of failing to encode (a 500)."""

    def render(self, content: Any) -> bytes:
        """The body: `json_bytes(content)`."""
        return json_bytes(content)


def json_bytes(content: Any) -> bytes:
    """`content` as compact UTF-8 JSON, ASCII-escaped where its text is not valid Unicode (a lone surrogate).

    orjson encodes it, 15 times faster than `json.dumps`: a whole answer of half a million log-prob entries holds
    the interpreter lock for about 0.05 s instead of 0.9 s. (It writes a non-finite float as null; answers' log-probs
    are made finite before.) Text that is not valid Unicode makes it refuse: `json.dumps` then escapes it."""
    try:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")
