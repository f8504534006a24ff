"""What every HTTP request passes before a handler sees it: the API key, the Host header of a loopback-only
server (so a web page cannot reach it through DNS rebinding), and where a request that changes something came
from: a browser sends a web page's cross-site POST with its `Origin` (and `Sec-Fetch-Site`), and a body-less one
(`/pause`, `/abort_requests` ...) needs no CORS preflight, so a keyless worker would otherwise obey any page its user
opens. Programs (the `openai` client, httpx, curl) send neither header. Bodies are read by bodies.py.

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
# Methods that change nothing: a cross-site page may read nothing of their answers either (no CORS headers are sent).
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


class RequestGuard:
    """ASGI middleware: 401 without `Authorization: Bearer <api_key>` (when one is set; /health is open), 421 for a
    Host header a loopback-only server does not answer to, 403 for a browser's cross-site request that is not a
    GET. With a control key, the control paths need it and no other key (a tenant holding the generation key cannot
    pause or abort the others); it opens every other path too."""

    def __init__(
        self,
        app: Any,
        api_key: str | None,
        loopback_only: bool,
        control_api_key: str | None = None,
        control_paths: frozenset[str] = frozenset(),
    ):
        """
        Args:
            app: the application it guards.
            api_key: the bearer token every path but /health needs (None: none).
            loopback_only: the server listens on loopback: only loopback host names are answered.
            control_api_key: the bearer token the control paths need (None: they need `api_key`, as every path).
            control_paths: the control routes' paths.
        """
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.control = None if control_api_key is None else f"Bearer {control_api_key}".encode()
        self.control_paths = control_paths
        self.loopback_only = loopback_only

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            error = None
            if self.loopback_only and not is_loopback_host(headers.get(b"host", b"")):
                error = APIError(421, "this server answers only to loopback host names", None)
            elif scope["method"] not in SAFE_METHODS and _cross_site(headers):
                error = APIError(
                    403, "cross-site requests from a web page are refused (its Origin is not this server)", None
                )
            elif scope["path"] not in OPEN_PATHS:
                error = self._key_error(scope["path"], _bearer(headers.get(b"authorization", b"")))
            if error is not None:
                # The body is never read: the connection cannot carry another request (a keep-alive client opens a
                # new one). A 401 names the scheme it takes (RFC 9110 11.6.1).
                headers = {"Connection": "close"} | ({"WWW-Authenticate": "Bearer"} if error.status == 401 else {})
                await SafeJSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _key_error(self, path: str, given: bytes) -> APIError | None:
        """The 401 for a request whose key does not open `path` (None: it does). Keys are compared in constant time:
        the time taken must not tell how much of a guessed key was right."""
        control = self.control is not None and hmac.compare_digest(given, self.control)
        if path in self.control_paths and self.control is not None:
            if control:
                return None
            return APIError(
                401,
                "this control route needs the worker's control key (--control-api-key)",
                None,
                "authentication_error",
            )
        if self.expected is None or control or hmac.compare_digest(given, self.expected):
            return None
        return APIError(401, "a valid API key is required (Authorization: Bearer ...)", None, "authentication_error")


def _bearer(given: bytes) -> bytes:
    """The Authorization header with its scheme spelled "Bearer" and one space after it (schemes are case-insensitive,
    and one or more spaces may follow them: RFC 9110 11.1, 11.4)."""
    scheme, space, token = given.partition(b" ")
    return b"Bearer " + token.lstrip(b" ") if space and scheme.lower() == b"bearer" else given


def _cross_site(headers: dict[bytes, bytes]) -> bool:
    """Whether a browser sent this request from another site's page. A browser's own word decides when it sends it
    (`Sec-Fetch-Site`: "same-origin", or "none" for what its user typed, pass; "same-site" and "cross-site" do not,
    a page on another port of this host included). Else its `Origin` (scheme://host[:port], or "null" from a
    sandboxed page or a file) must name the host the request was sent to: the `Host` header, or the
    `X-Forwarded-Host` a reverse proxy that rewrites `Host` sets, default ports (80, 443) left out. A request with
    neither header is not a browser's cross-site one."""
    fetch_site = headers.get(b"sec-fetch-site")
    if fetch_site is not None:
        return fetch_site.strip().lower() not in (b"same-origin", b"none")
    origin = headers.get(b"origin")
    if origin is None:
        return False
    scheme, _, origin_host = origin.strip().lower().partition(b"://")
    if not origin_host:
        return True
    default = {b"http": b":80", b"https": b":443"}.get(scheme, b"")
    hosts = {headers.get(b"host", b""), *headers.get(b"x-forwarded-host", b"").split(b",")}
    targets = {host.strip().lower().removesuffix(default) for host in hosts if host.strip()}
    return origin_host.removesuffix(default) not in targets
