"""An HTTP request's structured-output constraint, compiled by the worker's compile slots (constraint_compiles.py)
in turn with every other client, HTTP and ZeroMQ alike (an HTTP client is its address: its connections share one
turn), and awaited on the event loop; a client that leaves meanwhile, or whose request is cancelled, abandons its
compile (its compile process is killed)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from rollout.config import FieldError
from rollout.engine.manager.continuous_batching import QueueFullError
from rollout.service.compile.constraint_compiles import ConstraintCompiles
from rollout.service.compile.jobs import CompileAbandoned, CompileJob, CompilesClosed, CompilesUnavailable
from rollout.service.http.api.bridge import DISCONNECT_POLL_S, ClientGone
from rollout.service.http.errors import APIError, bad_field, busy


def client_address(request: Any) -> str:
    """An HTTP client's turn at the compile slots: its address (all its connections share it)."""
    client = getattr(request, "client", None)
    return client.host if client is not None else "unknown"


async def compile_constraint(
    compiles: ConstraintCompiles,
    sampling: Any,
    param: str,
    client: str,
    disconnected: Callable[[], Awaitable[bool]] | None = None,
) -> None:
    """Wait until `sampling`'s constraint is compiled and checked (the engine then finds it in its cache).

    Args:
        compiles: the worker's compile slots.
        sampling: the request's SamplingParams (it has a constraint).
        param: the client's name of the constraint field (what a refusal names).
        client: the client's address.
        disconnected: says whether the client left (polled while waiting).
    Raises:
        APIError: 400 naming `param` (a spec that does not compile, within the budget or at all, or that no
            sample can follow), 503 busy (too many compiles waiting, the worker stopping), 503 (no compile server).
        ClientGone: the client left (its compile is abandoned).
    """
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[BaseException | None] = loop.create_future()

    def done(_: CompileJob, error: BaseException | None) -> None:  # a compile slot's thread, or this one
        try:
            loop.call_soon_threadsafe(_settle, outcome, error)
        except RuntimeError:  # the loop closed (the server stopped): nobody waits for it
            pass

    try:
        job = compiles.submit(("http", client), sampling, done, None)
    except QueueFullError as error:
        raise busy(str(error)) from None
    try:
        while True:
            try:
                error = await asyncio.wait_for(asyncio.shield(outcome), DISCONNECT_POLL_S)
                break
            except asyncio.TimeoutError:
                if disconnected is not None and await disconnected():
                    compiles.cancel(job)
                    raise ClientGone from None
    except asyncio.CancelledError:
        compiles.cancel(job)
        raise
    if error is None:
        return
    if isinstance(error, FieldError):
        raise bad_field(param, error.reason) from None
    if isinstance(error, CompilesClosed):
        raise busy("the worker is stopping; retry") from None
    if isinstance(error, CompileAbandoned):
        raise ClientGone from None
    if isinstance(error, CompilesUnavailable):
        raise APIError(503, str(error), None, "service_unavailable_error") from None
    raise APIError(500, f"compiling {param} failed: {type(error).__name__}: {error}", None, "internal_server_error")


def _settle(outcome: asyncio.Future, error: BaseException | None) -> None:
    if not outcome.done():
        outcome.set_result(error)
