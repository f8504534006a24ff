"""`RequestMetrics`: ASGI middleware around the whole HTTP app that reports every request answered (its endpoint,
status and time to the end of its answer) to the worker's metrics, refusals by the guard and 500s included."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class RequestMetrics:
    """Observes each HTTP request once, when its answer's last byte is sent (or when it ends without one)."""

    def __init__(self, app: Any, observe: Callable[[str, int, float], None], endpoints: frozenset[str]):
        """
        Args:
            app: the ASGI application.
            observe: called with (endpoint, status, seconds) per request (`WorkerMetrics.observe_http`).
            endpoints: the paths reported by name; any other path is reported as "other", so that the labels stay
                a bounded set whatever clients send.
        """
        self.app = app
        self.observe = observe
        self.endpoints = endpoints

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
        start = time.perf_counter()
        status: int | None = None
        observed = False

        async def observing_send(message: dict) -> None:
            nonlocal status, observed
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not observed:
                observed = True
                self.observe(endpoint, status or 500, time.perf_counter() - start)

        try:
            await self.app(scope, receive, observing_send)
        finally:
            if not observed:  # the client left mid-answer, or the app failed before answering (uvicorn sends 500)
                self.observe(endpoint, status or 500, time.perf_counter() - start)
