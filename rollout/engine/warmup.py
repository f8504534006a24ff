"""Warming an engine up before it serves: decode graphs captured and first-call costs paid, leaving no trace."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Protocol

from rollout.config import SamplingParams
from rollout.engine.counters import StepCounters


class WarmableEngine(Protocol):
    """What `warm_up` uses of an `Engine` (structural: this module does not import the engine)."""

    runner: Any
    block_manager: Any
    scheduler: Any
    max_model_len: int
    counters: StepCounters
    warmed_up: bool

    def has_unfinished(self) -> bool: ...

    def add_request(self, group_id: str, prompt_ids: Any, sampling: Any = None) -> list[str]: ...

    def step(self) -> list[Any]: ...


def warm_up(engine: WarmableEngine, num_tokens: int = 8) -> None:
    """Capture the decode CUDA graph of every batch bucket (when graphs are on), then run one short request
    (allocator, prefill kernels), so that no later step pays for them. Leaves no trace: its cached prefix is
    forgotten, and the token and step counters and what admission learned from finished requests are restored.
    Call it while the engine is idle.

    Args:
        num_tokens: length of the warm-up prompt.
    Raises:
        RuntimeError: the warm-up request ended with an error (the model's forward fails: every request would).
    """
    if engine.has_unfinished():
        raise RuntimeError("warmup() needs an idle engine")
    if engine.runner.closed:
        raise RuntimeError("warmup() of a closed engine: build a new one")
    engine.runner.capture_graphs()  # largest bucket first, so the smaller ones reuse its memory
    counters = replace(engine.counters)
    growth = copy.deepcopy(engine.scheduler.admission.growth)  # what admission learns from finished requests
    sampling = SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=2, seed=0)  # draws no seed
    # A short context, or a cache of a few tokens, must not refuse its own warm-up (prompt + 2 new tokens - 1 fit).
    cache_tokens = engine.block_manager.num_blocks * engine.block_manager.block_size
    num_tokens = min(num_tokens, engine.max_model_len - 2, cache_tokens - 1)
    if num_tokens > 0:
        engine.add_request("__warmup__", [0] * num_tokens, sampling)
    failures = []
    while engine.has_unfinished():
        failures += [output.error for output in engine.step() if output.finish_reason == "error"]
    engine.block_manager.reset_prefix_cache()
    if engine.scheduler.drafter is not None:  # its tokens are no one's drafts
        engine.scheduler.drafter.forget([0] * num_tokens)
    # The warm-up is not served work: statistics start from where they were.
    engine.counters.restore(counters)
    engine.scheduler.admission.growth = growth  # a 2-token request at its max_new_tokens would say lengths are known
    engine.block_manager.num_prefix_tokens_hit = engine.block_manager.num_prefix_tokens_queried = 0
    if failures:  # every request would end so: refused here, not after the worker said it is ready
        raise RuntimeError(f"the engine's warm-up request failed: {failures[0]}")
    engine.warmed_up = True
