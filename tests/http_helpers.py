"""An in-process OpenAI-compatible server over a model, for the HTTP tests: `serving` (the server) and
`openai_client` (the official `openai` client at it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai

from rollout.config import ContinuousBatchingConfig
from rollout.engine.manager.continuous_batching import init_continuous_batching
from rollout.service.http.serving.server import HttpServer
from rollout.service.http.serving.settings import HttpSettings


@contextmanager
def serving(
    model: Any, tokenizer: Any, settings: HttpSettings, num_blocks: int = 16, block_size: int = 16, **server: Any
) -> Iterator[HttpServer]:
    """`model` behind a started HTTP server (its engine manager at `.manager`); both stopped on exit.

    Args:
        model: the served model.
        tokenizer: its tokenizer.
        settings: the server's settings.
        num_blocks, block_size: the engine's KV cache.
        **server: more `HttpServer` arguments (e.g. `observe`).
    """
    config = ContinuousBatchingConfig(num_blocks=num_blocks, block_size=block_size)
    manager = init_continuous_batching(model, continuous_batching_config=config, tokenizer=tokenizer).start()
    http = HttpServer(manager, tokenizer, settings, **server).start()
    http.manager = manager
    try:
        yield http
    finally:
        http.stop()
        manager.stop()


@contextmanager
def openai_client(url: str, timeout: float = 60) -> Iterator[openai.OpenAI]:
    """The official `openai` client at a server's `url` (no retries: a refusal is the test's answer)."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout) as client:
        yield client
