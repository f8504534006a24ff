"""`HttpServer`: uvicorn serving the OpenAI-compatible app on its own thread of the worker process, next to the
ZeroMQ serving loop, both over the same engine manager."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rollout.engine.manager import ContinuousBatchingManager
from rollout.service.http.settings import HttpSettings

logger = logging.getLogger(__name__)
# Seconds open requests get to finish when the worker stops; streams still open then are closed.
GRACEFUL_SHUTDOWN_S = 3.0


class HttpServer:
    """The HTTP front end of one worker."""

    def __init__(self, manager: ContinuousBatchingManager, tokenizer: Any, settings: HttpSettings):
        """
        Args:
            manager: the worker's engine manager.
            tokenizer: the worker's tokenizer (None: text endpoints answer 400).
            settings: where to listen and how to serve (`HttpSettings`; port 0 picks a free one, `port` then says
                which once started).
        """
        try:
            import uvicorn

            from rollout.service.http.app import build_app
        except ImportError as error:
            raise ImportError(
                f"rollout-worker --http needs FastAPI and uvicorn: pip install 'rollout[http]' ({error})"
            ) from None
        config = uvicorn.Config(
            build_app(manager, tokenizer, settings),
            host=settings.host,
            port=settings.port,
            log_level="warning",
            lifespan="off",
            access_log=False,
            limit_concurrency=settings.max_connections,
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
        """Stop serving (open streams are closed; their groups cancelled) and wait for the thread."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the HTTP server did not stop within %.0f s", timeout)
