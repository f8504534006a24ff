"""Host headers a loopback-only HTTP server answers to: anything else is a web page that reached it through DNS
rebinding (its name resolving to 127.0.0.1), and is refused (the API's 421, the metrics server's 421)."""

from __future__ import annotations

import re

# Host names a loopback-only server answers to (any port).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")
# A Host header: a bracketed IPv6 address or a name without ':', '@', '/' or brackets, and an optional port.
_HOST = re.compile(r"(?P<name>\[[0-9a-f:.]+\]|[^:@/\[\]\s]+)(?::\d{1,5})?")


def host_name(host: bytes | str) -> str:
    """The host name of a Host header, lower-cased, without its port ("" when the header is not a host name with an
    optional numeric port: `localhost:80@evil.com` and `[::1]evil.com` name no loopback host)."""
    text = (host.decode("latin-1") if isinstance(host, bytes) else host).strip().lower()
    match = _HOST.fullmatch(text)
    if match is None:
        return "::1" if text == "::1" else ""  # a bare IPv6 loopback, as some clients send it
    return match.group("name")


def is_loopback_host(host: bytes | str) -> bool:
    """The Host header names a loopback address."""
    return host_name(host) in LOOPBACK_HOSTS
