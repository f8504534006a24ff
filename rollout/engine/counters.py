"""An engine's counters as one snapshot: what `ContinuousBatchingManager.stats()`, the worker's `stats` reply and
its Prometheus metrics report."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout.engine.engine import Engine


def engine_stats(engine: Engine) -> dict[str, Any]:
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
