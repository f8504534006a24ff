"""Request bodies in, bounded: what a client may make the worker receive, hold and parse.

Parsing JSON (`json.loads`) is one C call that holds the interpreter lock from its first byte to its last, and so do
freeing what it built and the garbage collections its containers trigger: while it runs, the event loop that answers
every client and the engine's serving loop both wait. A 15 MB body of five million empty lists holds the lock for
seconds. So a body's shape is counted while it arrives (at C speed, chunk by chunk) and a body over the limits is
refused before it is parsed, or even fully received; big bodies are parsed one at a time (two would take turns
holding the lock, stalling the loop twice as long); and the bytes being received are capped per client address and
in all, so many slow uploads cannot hold the worker's memory.

The counts are upper bounds: every JSON array and object has an opening bracket, and every value after a
container's first is preceded by a comma. Brackets and commas inside strings count too, which only a prompt far
longer than any context could reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from rollout.service.http.api.bridge import ClientGone
from rollout.service.http.errors import APIError
from rollout.service.http.serving.json_body import BIG_BODY_BYTES, parse_json
from rollout.service.http.serving.settings import (
    MAX_BODY_CONTAINERS,
    MAX_BODY_ELEMENTS,
    MAX_BODY_STRINGS,
    PARSED_BYTES_PER_STRING,
    PARSED_BYTES_PER_VALUE,
)

# Most seconds a client may take to send its request body.
BODY_TIMEOUT_S = 30.0


@dataclass
class BodyShape:
    """The containers, values and strings of a body, counted chunk by chunk as it arrives."""

    containers: int = 0
    elements: int = 0
    quotes: int = 0

    def feed(self, chunk: bytes) -> int:
        """Count one chunk; returns what its values may take once parsed, in bytes (`PARSED_BYTES_PER_VALUE` per
        container and comma, `PARSED_BYTES_PER_STRING` per pair of double quotes).

        Raises:
            APIError: 413 once the body holds more containers, values or strings than a body may.
        """
        containers, elements, quotes = chunk.count(b"[") + chunk.count(b"{"), chunk.count(b","), chunk.count(b'"')
        self.containers += containers
        self.elements += elements
        self.quotes += quotes
        if self.containers > MAX_BODY_CONTAINERS:
            reason = f"the request body holds over {MAX_BODY_CONTAINERS} JSON arrays and objects, the most one may"
            raise APIError(413, reason)
        if self.elements > MAX_BODY_ELEMENTS:
            raise APIError(413, f"the request body holds over {MAX_BODY_ELEMENTS} JSON values, the most one may")
        if self.quotes > 2 * MAX_BODY_STRINGS:
            raise APIError(413, f"the request body holds over {MAX_BODY_STRINGS} JSON strings, the most one may")
        return (containers + elements) * PARSED_BYTES_PER_VALUE + (quotes // 2 + 1) * PARSED_BYTES_PER_STRING


@dataclass
class ReceiveBudget:
    """Bytes of request bodies being received and parsed (a body's bytes plus what its parsed values may take,
    `BodyShape.feed`), capped per client address and in all (event-loop thread only: no lock).

    Attributes:
        total_bytes: most bytes held at once for all clients; past it a request is answered 503 (retry later).
        per_client_bytes: most bytes held at once for one client address; past it its request is answered 429.
    """

    total_bytes: int
    per_client_bytes: int
    held: int = 0
    by_client: Counter = field(default_factory=Counter)

    def reserve(self, client: str, size: int) -> None:
        """Hold `size` more bytes for `client`.

        Raises:
            APIError: 429 past the client's share, 503 past the worker's total (nothing is held then).
        """
        if self.by_client[client] + size > self.per_client_bytes:
            reason = (
                f"this client is already sending {self.by_client[client]} bytes of request bodies; the worker "
                f"holds at most {self.per_client_bytes} per client address: wait for its other requests"
            )
            raise APIError(429, reason, None, "rate_limit_error", "too_many_body_bytes")
        if self.held + size > self.total_bytes:
            reason = f"the worker is receiving {self.held} bytes of request bodies, the most it holds; retry later"
            raise APIError(503, reason, None, "service_unavailable_error", "busy")
        self.held += size
        self.by_client[client] += size

    def release(self, client: str, size: int) -> None:
        """Give back `size` bytes held for `client`."""
        self.held -= size
        left = self.by_client[client] - size
        if left > 0:
            self.by_client[client] = left
        else:
            del self.by_client[client]


def check_headers(headers: Any, max_body_bytes: int) -> None:
    """Refuse, before reading it, a body this worker would not read as sent: not JSON, encoded (`Content-Encoding`),
    in another charset than UTF-8, or declared larger than `max_body_bytes`.

    Args:
        headers: the request's headers.
        max_body_bytes: the largest body taken.
    Raises:
        APIError: 415 naming the header; 413 a declared size over the limit.
    """
    kind, _, parameters = headers.get("content-type", "").partition(";")
    kind = kind.strip().lower()
    if kind != "application/json":
        reason = f"the request body must be JSON (Content-Type: application/json), got {kind or 'none'!r}"
        raise APIError(415, reason)
    for parameter in parameters.split(";"):
        name, _, value = parameter.partition("=")
        charset = value.strip().strip('"').lower()
        if name.strip().lower() == "charset" and charset.replace("-", "") not in ("utf8", "usascii", "ascii"):
            raise APIError(
                415, f"Content-Type: the body is read as UTF-8 (JSON's encoding), not as charset {charset!r}"
            )
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(415, f"Content-Encoding {encoding!r}: this worker reads request bodies as sent, not encoded")
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise APIError(413, f"the request body is {declared} bytes; this worker takes at most {max_body_bytes}")


class BodyIntake:
    """Reads and parses the JSON bodies of one server: within a size and a time limit, counted as they arrive,
    within the worker's receive budget, parsed off the event loop (big ones one at a time)."""

    def __init__(self, max_body_bytes: int, budget: ReceiveBudget):
        """
        Args:
            max_body_bytes: largest body (larger ones are answered 413).
            budget: the bytes all clients, and each client address, may have in flight.
        """
        self.max_body_bytes = max_body_bytes
        self.budget = budget
        self._big = ThreadPoolExecutor(1, thread_name_prefix="rollout-http-parse")
        # Set when the server stops (`stop_reading`, from another thread): bodies still arriving are answered 503 at
        # once, instead of holding the shutdown for its grace period and then being cancelled mid-read.
        # One event per loop that reads bodies (the server's; tests may run others), each set from the stopping thread.
        self._stopping: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Event] = (
            weakref.WeakKeyDictionary()
        )
        self._stop_requested = False

    @asynccontextmanager
    async def body(self, request: Request) -> AsyncIterator[Any]:
        """The request's JSON body, parsed; its bytes count against the budget until the block ends.

        Raises:
            APIError: a query parameter (400: the fields are the body's), not declared as JSON or encoded (415),
                over the size or shape limits, or alone over a client's share of the budget (413), too slow (408),
                over the client's share of the budget (429) or the worker's (503), not JSON or a key given twice
                (400). One raised before the body was read whole closes the connection.
            ClientGone: the client left while sending it.
        """
        client = request.client.host if request.client is not None else ""
        held = [0]  # bytes reserved for this body so far

        def hold(size: int) -> None:
            if held[0] + size > self.budget.per_client_bytes:  # this body alone: no wait would let it in
                reason = (
                    "the request body, with what its JSON values take once parsed (40 bytes each, 32 more per "
                    f"string), is over the {self.budget.per_client_bytes} bytes this worker holds for one client "
                    "(its --http-max-receiving-bytes-per-client): send fewer values"
                )
                raise APIError(413, reason)
            self.budget.reserve(client, size)
            held[0] += size

        try:
            try:
                for name in request.query_params:  # a route that reads a JSON body takes its fields from there alone
                    reason = f"unknown query parameter ({request.url.path} reads its fields from the JSON body)"
                    raise APIError(400, f"query.{name}: {reason}", f"query.{name}")
                check_headers(request.headers, self.max_body_bytes)
                raw = await self._read(request, hold)
            except APIError as refused:  # the rest of the body stays unread: no request may follow on this connection
                refused.close_connection = True
                raise
            parsed = await self._parse(raw)
            del raw  # (the parsed body is what the handler holds, and must drop at the end of the block)
            yield parsed
        finally:
            self.budget.release(client, held[0])

    async def first_bytes(self, request: Request, most: int) -> bytes:
        """The body's first bytes, at most `most` and maybe a chunk more (a route that reads no body checks that it
        says nothing), within the same time limit as a whole body.

        Args:
            request: the request.
            most: stop reading past this many bytes.
        Raises:
            APIError: (408) they did not arrive in time. ClientGone: the client left while sending them.
        """
        head = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                head.extend(chunk)
                if len(head) > most:
                    return

        await self._in_time(read())
        return bytes(head)

    async def _read(self, request: Request, hold: Callable[[int], None]) -> bytearray:
        body, shape, limit = bytearray(), BodyShape(), self.max_body_bytes

        async def read() -> None:
            async for chunk in request.stream():
                if len(body) + len(chunk) > limit:
                    raise APIError(413, f"the request body is over {limit} bytes, the most this worker takes")
                hold(len(chunk) + shape.feed(chunk))
                body.extend(chunk)

        await self._in_time(read())
        return body  # (json.loads takes a bytearray: no copy)

    async def _parse(self, raw: bytearray) -> Any:
        if len(raw) < BIG_BODY_BYTES:
            return await asyncio.to_thread(parse_json, raw)
        return await asyncio.get_running_loop().run_in_executor(self._big, parse_json, raw)

    def stop_reading(self) -> None:
        """Answer the bodies still arriving 503 (the server is stopping); from any thread, any number of times."""
        self._stop_requested = True
        for loop, stopping in list(self._stopping.items()):
            try:
                loop.call_soon_threadsafe(stopping.set)
            except RuntimeError:  # the loop has closed: nothing is reading
                pass

    def close(self) -> None:
        """Stop the parse thread (a parse in progress finishes first)."""
        self._big.shutdown(wait=True, cancel_futures=True)

    async def _in_time(self, reading: Coroutine[Any, Any, None]) -> None:
        """Await a body's reading within `BODY_TIMEOUT_S`, unless the server stops first.

        Raises:
            APIError: (408) it did not arrive in time; (503) the server is stopping. ClientGone: the client left
                while sending it.
        """
        loop = asyncio.get_running_loop()
        stopping = self._stopping.get(loop)
        if stopping is None:  # the first body read on this loop
            stopping = self._stopping[loop] = asyncio.Event()
            if self._stop_requested:
                stopping.set()
        read = asyncio.ensure_future(asyncio.wait_for(reading, BODY_TIMEOUT_S))
        stop = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait((read, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (read, stop):
                task.cancel()
        if not read.done() or read.cancelled():
            with contextlib.suppress(asyncio.CancelledError):
                await read
            raise APIError(503, "the worker is stopping: send the request again", None, "service_unavailable_error")
        try:
            read.result()
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
        except ClientDisconnect:
            raise ClientGone from None
