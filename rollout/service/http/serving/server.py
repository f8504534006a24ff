"""`HttpServer`: uvicorn serving the OpenAI-compatible app on its own thread of the worker process, next to the
ZeroMQ serving loop, both over the same engine manager."""

from __future__ import annotations

import ctypes
import logging
import resource
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollout.engine.manager.continuous_batching import ContinuousBatchingManager
from rollout.service.group_counters import GroupCounters
from rollout.service.http.serving.settings import HttpSettings

if TYPE_CHECKING:  # (the routes import FastAPI, which this module loads without)
    from rollout.service.http.control.routes import UpdateListener

logger = logging.getLogger(__name__)
# Seconds open requests get to finish when the worker stops; streams still open then are closed.
GRACEFUL_SHUTDOWN_S = 3.0
# Open files the worker asks for (up to the hard limit): each HTTP client holds a socket, and a common soft limit of
# 1,024 would refuse hundreds of agent clients' connections long before the server's own limits do.
OPEN_FILES_WANTED = 65536
# Allocations from this size up are mapped on their own and unmapped when freed (glibc's M_MMAP_THRESHOLD).
OWN_MAPPING_BYTES = 1 << 20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> None:
    """Raise this process's soft limit of open files towards `wanted`, never past the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as error:
            logger.warning("could not raise the open files limit from %d to %d: %s", soft, target, error)


def give_freed_buffers_back() -> None:
    """Make glibc map allocations of `OWN_MAPPING_BYTES` and more on their own, so freeing one gives its memory
    back to the system (no-op off glibc).

    By default glibc raises this threshold each time such a mapping is freed (up to 32 MB): after the first request
    body of 15 MB is freed, later ones are carved from the heap, where the holes they leave stay resident. Sixty
    stalled uploads then grew the worker's RSS past what its receive budget holds (250-300 MB for 180 MB held).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return
    if mallopt(M_MMAP_THRESHOLD, OWN_MAPPING_BYTES) != 1:
        logger.warning("could not set glibc's mmap threshold: freed request bodies may stay resident")


# FastAPI (0.165, and some releases before it) classifies each endpoint and dependency callable once, in module caches
# keyed by the callable itself (up to 4,096 of each): our endpoints are closures over the manager, its engine, the
# model and the tokenizer, so every app ever built would keep its whole engine, the model's weights included,
# reachable from there long after its server stopped.
_FASTAPI_CALLABLE_CACHES = ("_is_gen_callable_cached", "_is_async_gen_callable_cached", "_is_coroutine_callable_cached")


def release_app(app: Any) -> None:
    """Let go of what a stopped app holds of the worker, at once. A FastAPI app and its router refer to each other (a
    cycle only the garbage collector frees), and FastAPI's own caches keep every endpoint callable: the routes (their
    closures hold the manager, its engine, the model and the tokenizer) and the app's state are dropped from the app,
    and those caches emptied (no-op on a FastAPI without them). Other apps in the process lose nothing but cached
    classifications, made again at their next request.

    Args:
        app: the FastAPI application `build_app` made, its server stopped.
    """
    app.router.routes.clear()
    app.state = type(app.state)()
    try:
        from fastapi.dependencies import models
    except ImportError:
        return
    for name in _FASTAPI_CALLABLE_CACHES:
        cache_clear = getattr(getattr(models, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


class HttpServer:
    """The HTTP front end of one worker."""

    def __init__(
        self,
        manager: ContinuousBatchingManager,
        tokenizer: Any,
        settings: HttpSettings,
        counters: GroupCounters | None = None,
        observe: Callable[[str, int, float], None] | None = None,
        compiles: Any = None,
        updates: UpdateListener | None = None,
    ):
        """
        Args:
            manager: the worker's engine manager.
            tokenizer: the worker's tokenizer (None: text endpoints answer 400).
            settings: where to listen and how to serve (`HttpSettings`; port 0 picks a free one, `port` then says
                which once started).
            counters: the worker's group counters, which HTTP groups add to (None: a set of their own).
            observe: called with (endpoint, status, seconds) for every request answered (`WorkerMetrics.
                observe_http`); None: not observed.
            compiles: the worker's structured-output compile slots (ConstraintCompiles; None: the app's own).
            updates: told of each /update_weights committed or refused (`UpdateListener`).
        """
        try:
            import uvicorn

            from rollout.service.http.serving.app import ENDPOINTS, build_app
            from rollout.service.http.serving.connections import WaitingConnections, protocol_for
            from rollout.service.http.serving.request_metrics import RequestMetrics
        except ImportError as error:
            raise ImportError(
                f"rollout-worker --http needs FastAPI and uvicorn: pip install 'rollout[http]' ({error})"
            ) from None
        app = build_app(manager, tokenizer, settings, counters, compiles, updates)
        self._app, self._close_app = app, app.state.close
        self._stop_reading = app.state.stop_reading  # (dropped by `stop`, as the app is)
        if observe is not None:
            app = RequestMetrics(app, observe, ENDPOINTS)
        # No cap on connections as a whole (uvicorn's limit_concurrency): idle sockets would take the API down.
        # Only connections that have not sent a request head are timed and capped.
        self.waiting = WaitingConnections(settings.head_timeout_s, settings.max_waiting_connections)
        raise_open_files_limit()
        give_freed_buffers_back()
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            http=protocol_for(self.waiting),
            log_level="error",  # not a warning per malformed request: one client could flood the log
            lifespan="off",
            access_log=False,
            timeout_keep_alive=settings.keep_alive_timeout_s,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self.host = settings.host
        self.port = settings.port

    def start(self, timeout: float = 30.0) -> HttpServer:
        """Start serving on a background thread; return once it listens.

        Raises:
            RuntimeError: it did not start within `timeout` seconds (the port is taken, for one).
        """
        self._thread = threading.Thread(target=self._server.run, name="rollout-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()  # nothing of a server that did not start stays: its thread, the app's threads, the app
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        sockets = [s for server in self._server.servers for s in server.sockets]
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        """The base URL clients use (OpenAI clients: this + "/v1")."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (open streams are closed; their groups cancelled) and wait for the thread; then release the
        app: its compile and parse threads, and what it holds of the worker (`release_app`). Safe to call again."""
        self._stop_reading()  # a body still arriving would hold the shutdown for its grace period
        self._stop_reading = _nothing_to_stop
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the HTTP server did not stop within %.0f s", timeout)
        self._close_app()
        release_app(self._app)


def _nothing_to_stop() -> None:
    """What a stopped server's `stop_reading` is: its app's bodies are gone."""
