"""Host headers a loopback-only HTTP server answers to: anything else is a web page that reached it through DNS
rebinding (its name resolving to 127.0.0.1), and is refused (the API's 421, the metrics server's 421)."""

from __future__ import annotations

# Host names a loopback-only server answers to (any port).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def host_name(host: bytes | str) -> str:
    """The host name of a Host header, lower-cased, without its port."""
    text = (host.decode("latin-1") if isinstance(host, bytes) else host).strip().lower()
    if text.startswith("["):
        return text[: text.find("]") + 1]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def is_loopback_host(host: bytes | str) -> bool:
    """The Host header names a loopback address."""
    return host_name(host) in LOOPBACK_HOSTS
