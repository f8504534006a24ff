"""`continuous_batching_context_manager`: transformers' `model.continuous_batching_context_manager(...)` as a
function of the model, so that code written for transformers carries over with the model as first argument.

Its exit is transformers': the requests already added run to their end (`stop(hard_stop=False)`), whereas
`with init_continuous_batching(...) as manager:` (rollout's own form) ends them at once. An exception raised in the
block (Ctrl-C too) ends them at once here as well (transformers would still wait for them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rollout.engine.manager.continuous_batching import ContinuousBatchingManager, init_continuous_batching

__all__ = ["continuous_batching_context_manager"]


@contextmanager
def continuous_batching_context_manager(
    model: torch.nn.Module,
    generation_config: Any = None,
    block: bool = True,
    timeout: float | None = None,
    continuous_batching_config: Any = None,
    persistent_manager: bool = False,
    warmup: bool = True,
    tokenizer: Any = None,
) -> Iterator[ContinuousBatchingManager]:
    """A started manager for `model` inside the block; on a normal exit, the requests added run to their end, then
    it stops; on an exception, they end at once (finish_reason "abort").

    Arguments are transformers' own, in its order after the model:

    Args:
        model: a transformers causal LM.
        generation_config: default sampling settings (`transformers.GenerationConfig`), merged with the model's own.
        block: on exit, wait for the engine thread to finish the requests added and end.
        timeout: most seconds to wait on exit when blocking (None: until they finish).
        continuous_batching_config: engine settings: rollout's or transformers' ContinuousBatchingConfig.
        persistent_manager: refused when True (transformers keeps its manager on the model for the next call; rollout
            keeps an engine with `generate_batch(..., persistent_manager=True)`).
        warmup: capture the decode CUDA graphs and run a short request before the block (once per engine).
        tokenizer: the model's tokenizer, for stop strings; None refuses them (rollout's addition, last).
    Raises:
        ValueError: persistent_manager is True (before anything is built).
    """
    if persistent_manager:
        raise ValueError(
            "persistent_manager: not supported by continuous_batching_context_manager; a manager does not restart. "
            "To keep an engine between calls, use generate_batch(..., persistent_manager=True)"
        )
    manager = init_continuous_batching(model, generation_config, continuous_batching_config, tokenizer)
    try:
        if warmup:
            manager.warmup()
        manager.start()
    except BaseException:
        manager.stop(block=True)  # frees the KV cache the manager allocated (a stop before start ends it at once)
        raise
    try:
        yield manager
    except BaseException:
        manager.stop(block=block, timeout=timeout)  # an error in the block (Ctrl-C too) ends the requests at once
        raise
    manager.stop(block=block, timeout=timeout, hard_stop=False)
