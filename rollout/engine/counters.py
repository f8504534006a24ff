"""An engine's counters as one snapshot (what `ContinuousBatchingManager.stats()`, the worker's `stats` reply and its
Prometheus metrics report), and what it still holds when it closes."""

from __future__ import annotations

import logging
from typing import Any, Protocol

logger = logging.getLogger("rollout.engine.engine")


class CountedEngine(Protocol):
    """What these functions read of an `Engine` (structural: this module does not import the engine)."""

    block_manager: Any
    scheduler: Any
    sampler: Any
    runner: Any
    policy_version: int
    num_weight_updates: int
    num_generated_tokens: int
    num_prefill_tokens: int
    num_steps: int


def engine_stats(engine: CountedEngine) -> dict[str, Any]:
    """The engine's counters (a snapshot): policy version, weight updates, queued and running samples, KV blocks,
    generated and prefilled tokens, prefix-cache hits, steps, preemptions."""
    blocks, scheduler = engine.block_manager, engine.scheduler
    return {
        "policy_version": engine.policy_version,
        "weight_updates": engine.num_weight_updates,
        "queued": scheduler.num_waiting,
        "running": len(scheduler.running),
        "kv_blocks_used": blocks.num_used_blocks,
        "kv_blocks_free": blocks.num_free_blocks,
        "generated_tokens": engine.num_generated_tokens,
        "prefill_tokens": engine.num_prefill_tokens,
        "prefix_cache_hit_tokens": blocks.num_prefix_tokens_hit,
        "prefix_cache_query_tokens": blocks.num_prefix_tokens_queried,
        "steps": engine.num_steps,
        "preemptions": scheduler.num_preemptions,
        "preemptions_swapped": scheduler.num_swaps,
    }


def log_leaks(engine: CountedEngine) -> None:
    """Log, as errors, the KV blocks, sampling slots and block-table rows a closing engine still holds (every request
    has ended by then: anything held is a leak)."""
    try:
        engine.block_manager.check_all_free()
    except AssertionError as leak:
        logger.error("engine closed with KV blocks still held: %s", leak)
    held = {"sampling slots": engine.sampler.slots.num_live, "block-table rows": engine.runner.block_tables.num_live}
    for what in [what for what, count in held.items() if count]:
        logger.error("engine closed with %d %s still held", held[what], what)
