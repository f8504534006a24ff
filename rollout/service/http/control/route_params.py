"""What a control route may be given beside its own parameters, checked as vLLM's routes would be misread: a query
parameter the route does not take or given twice, a choice or boolean out of its range (each a 400 naming
`query.<name>`), and a body on a route whose parameters go in the query string (a pause sent with `{"mode": "keep"}`
as its body must not run vLLM's default, "abort")."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from fastapi import Request

from rollout.service.http.errors import APIError, bad_field

if TYPE_CHECKING:  # the server (serving/) builds the intake: no import back
    from rollout.service.http.serving.bodies import BodyIntake

EMPTY_BODY_BYTES = 64  # a body-less route reads this much of a body at most: `{}` with whitespace fits


def query_choice(request: Request, name: str, default: str, choices: tuple[str, ...]) -> str:
    """The query parameter `name`, one of `choices` (`default` when not given)."""
    value = request.query_params.get(name, default)
    if value not in choices:
        raise bad_field(f"query.{name}", f"must be one of {list(choices)}, got {value!r}")
    return value


def query_bool(request: Request, name: str, default: bool) -> bool:
    """The query parameter `name` as a boolean (true/false, 1/0, yes/no, on/off; `default` when not given)."""
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() in ("true", "1", "yes", "on"):
        return True
    if value.lower() in ("false", "0", "no", "off"):
        return False
    raise bad_field(f"query.{name}", f"must be true or false, got {value!r}")


def query_only(request: Request, *names: str) -> None:
    """Refuse a query parameter the route does not take, naming it (a typo must not leave a default in force), and
    one given twice (`mode=abort&mode=keep`: which one holds would be a guess)."""
    for name in request.query_params:
        if name not in names:
            takes = f"it takes {', '.join(names)}" if names else "it takes none"
            raise bad_field(f"query.{name}", f"unknown query parameter ({request.url.path}: {takes})")
        if len(given := request.query_params.getlist(name)) > 1:
            raise bad_field(f"query.{name}", f"given {len(given)} times ({', '.join(map(repr, given))}): give it once")


async def no_body(request: Request, bodies: BodyIntake, parameters: str | None) -> None:
    """Refuse a body that says something on a route that reads none (its parameters go in the query string); an
    empty one (nothing, `{}`, `null`: what some vLLM clients send) says nothing and passes. Reads up to
    `EMPTY_BODY_BYTES`: anything longer says something."""
    if request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers:
        return
    if not _says_nothing(await bodies.first_bytes(request, EMPTY_BODY_BYTES)):
        where = f"its parameters ({parameters}) go in the query string" if parameters else "it takes no parameters"
        raise APIError(400, f"{request.url.path} takes no body: {where}", None)


def _says_nothing(raw: bytes) -> bool:
    """Whether a short body is empty: no bytes, or JSON `{}` or `null`."""
    if len(raw) > EMPTY_BODY_BYTES:
        return False
    if not raw.strip():
        return True
    try:
        return json.loads(raw) in ({}, None)
    except ValueError:
        return False
