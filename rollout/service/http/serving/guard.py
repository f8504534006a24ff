"""What every HTTP request passes before a handler sees it: the API key, and the Host header of a loopback-only
server (so a web page cannot reach it through DNS rebinding). Bodies are read by bodies.py.

The key and host checks are a pure ASGI middleware, not Starlette's BaseHTTPMiddleware: that one wraps `receive`,
and a handler then no longer sees its client leave.
"""

from __future__ import annotations

import hmac
from typing import Any

from rollout.service.http.errors import APIError, SafeJSONResponse
from rollout.service.loopback_hosts import is_loopback_host

# Paths anyone may call without the API key (load balancers probe them).
OPEN_PATHS = ("/health",)


class RequestGuard:
    """ASGI middleware: 401 without `Authorization: Bearer <api_key>` (when one is set; /health is open), 421 for a
    Host header a loopback-only server does not answer to."""

    def __init__(self, app: Any, api_key: str | None, loopback_only: bool):
        """
        Args:
            app: the application it guards.
            api_key: the bearer token every path but /health needs (None: none).
            loopback_only: the server listens on loopback: only loopback host names are answered.
        """
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.loopback_only = loopback_only

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            error = None
            if self.loopback_only and not is_loopback_host(headers.get(b"host", b"")):
                error = APIError(421, "this server answers only to loopback host names", None)
            elif self.expected is not None and scope["path"] not in OPEN_PATHS:
                # Compared in constant time: the time taken must not tell how much of a guessed key was right.
                if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                    message = "a valid API key is required (Authorization: Bearer ...)"
                    error = APIError(401, message, None, "authentication_error")
            if error is not None:
                await SafeJSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
