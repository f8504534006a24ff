"""The /metrics HTTP server: prometheus_client's exposition app on a thread of its own, answering only loopback
Host headers when it listens on loopback (a web page cannot read it through DNS rebinding)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from rollout.protocol.sockets import is_loopback
from rollout.service.loopback_hosts import is_loopback_host

# Seconds a scrape connection may take in all (a client that never finishes its request is closed), and scrapes
# served at once (each takes a thread: a flood must not take the worker's threads; one more shuts the oldest
# connection that has not sent its request).
SCRAPE_TIMEOUT_S = 10.0
MAX_CONCURRENT_SCRAPES = 16


class _QuietHandler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT_S  # socketserver applies it to the connection's socket

    def parse_request(self) -> bool:
        """Read the request head; once it is whole, the scrape is being answered and no newcomer evicts it."""
        parsed = super().parse_request()
        if parsed:
            self.server.answering(self.request)
        return parsed

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes are not logged."""


class _BoundedServer(ThreadingWSGIServer):
    """A thread per scrape, at most MAX_CONCURRENT_SCRAPES at once."""

    request_queue_size = 64  # socketserver's default backlog of 5 makes a burst of connections wait seconds

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT_SCRAPES)
        # A whole scrape within SCRAPE_TIMEOUT_S (the handler's timeout is per read: a byte every few seconds would
        # hold a slot for ever): one watchdog thread shuts down the connections past their deadline.
        self._deadlines: dict[Any, float] = {}
        self._answering: set[Any] = set()  # connections whose request head came: scrapes, never evicted
        self._deadlines_lock = threading.Lock()
        self._closing = threading.Event()
        super().__init__(*args, **kwargs)
        self._watchdog = threading.Thread(target=self._watch, name="rollout-metrics-deadlines", daemon=True)
        self._watchdog.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            # Every slot taken: the connection open longest that has not sent its request head makes way (silent
            # ones would otherwise keep every scrape out until their deadline, again and again), as the HTTP API
            # drops the one that waited longest; a scrape being answered is never cut. With none such, or a slot
            # that does not free within a second, the newcomer is closed: the scraper retries.
            if not self._shut_oldest_idle() or not self._slots.acquire(timeout=1.0):
                self.shutdown_request(request)
                return
        super().process_request(request, client_address)

    def answering(self, request: Any) -> None:
        """`request`'s head came whole (the handler's thread)."""
        with self._deadlines_lock:
            self._answering.add(request)

    def _shut_oldest_idle(self) -> bool:
        with self._deadlines_lock:
            idle = {
                request: deadline for request, deadline in self._deadlines.items() if request not in self._answering
            }
        oldest = min(idle, key=idle.__getitem__, default=None)
        if oldest is not None:
            _shut(oldest)
        return oldest is not None

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._deadlines_lock:
            self._deadlines[request] = time.monotonic() + SCRAPE_TIMEOUT_S
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._deadlines_lock:
                self._deadlines.pop(request, None)
                self._answering.discard(request)
            self._slots.release()

    def _watch(self) -> None:
        while not self._closing.wait(min(1.0, SCRAPE_TIMEOUT_S / 4)):
            now = time.monotonic()
            with self._deadlines_lock:
                late = [request for request, deadline in self._deadlines.items() if deadline < now]
            for request in late:
                _shut(request)

    def server_close(self) -> None:
        self._closing.set()
        super().server_close()
        watchdog = getattr(self, "_watchdog", None)  # None: socketserver closes a server whose bind failed
        if watchdog is not None:
            watchdog.join(5)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A scrape that timed out or hung up ends quietly (socketserver printed a traceback to stderr)."""


def _shut(connection: socket.socket) -> None:
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed meanwhile
        pass


def _host_checked(app: Any) -> Any:
    """`app`, answering 421 to a Host header that is not a loopback name."""

    def checked(environ: dict, start_response: Any) -> Any:
        if not is_loopback_host(environ.get("HTTP_HOST", "")):
            start_response("421 Misdirected Request", [("Content-Type", "text/plain")])
            return [b"this metrics server answers only to loopback host names\n"]
        return app(environ, start_response)

    return checked


class MetricsServer:
    """Serves one registry at http://HOST:PORT/metrics until `close`."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "127.0.0.1"):
        """Start serving (port 0 picks a free one; `port` then says which).

        Args:
            registry: what /metrics exposes.
            port: TCP port.
            host: address to listen on (a loopback address answers only loopback Host headers).

        Raises:
            OSError: it cannot listen there.
        """
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("MetricsWSGIServer", (_BoundedServer,), {"address_family": family})
        app = make_wsgi_app(registry)
        if is_loopback(f"tcp://{host}:{port}"):
            app = _host_checked(app)
        self._server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        self.port: int = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="rollout-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving, close the socket and wait for the thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
