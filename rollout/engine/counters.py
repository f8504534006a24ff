"""An engine's step counters; its counters as one snapshot (what `ContinuousBatchingManager.stats()`, the worker's
`stats` reply and its Prometheus metrics report); and what it still holds when it closes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any, Protocol

logger = logging.getLogger("rollout.engine.engine")


@dataclass
class StepCounters:
    """What an engine's steps and weight updates did since it started (its warm-up excluded)."""

    generated_tokens: int = 0  # tokens sampled and kept
    computed_tokens: int = 0  # tokens run through the model (prefix hits and forks skip theirs; drafts included)
    prefill_tokens: int = 0  # of which prompt or recompute tokens (all but the sampled tokens decodes compute)
    steps: int = 0
    # Verification rounds of drafted steps that drew on the device, each a round trip to it (speculative decoding;
    # samples whose draws read none of their tokens draw all positions with their step: `verify.sample_drafted`).
    verification_draws: int = 0
    # With overlapped scheduling, steps whose tokens were brought to the host before the next step was scheduled
    # (a drafted step, verified at once; a thin step before one that may draft): each one's host work adds to the
    # device's time instead of hiding under it.
    overlap_lost_steps: int = 0
    # Drafted steps, and the seconds their verification waited for their tokens to reach the host: on a GPU, what
    # of a drafted step's period is the device's (its forward and sampling); the rest is host work the device waited
    # through, since a drafted step is verified before the next one is scheduled (~0 on a CPU, which waits for nothing).
    drafted_steps: int = 0
    drafted_wait_s: float = 0.0
    weight_updates: int = 0

    def count_step(self, chunks: list[int], decodes: int, draft_tokens: int = 0) -> None:
        """Count a launched step of these chunk sizes, `decodes` of them one sampled token's (the rest prefill:
        prompt or recompute chunks), and the draft tokens its drafted decodes computed beside (speculative
        decoding; not in `chunks`)."""
        self.computed_tokens += sum(chunks) + draft_tokens
        self.prefill_tokens += sum(chunks) - decodes
        self.steps += 1
        self.drafted_steps += bool(draft_tokens)

    def restore(self, saved: StepCounters) -> None:
        """Set every counter back to `saved`'s value (work that was not served, such as a warm-up)."""
        for field in fields(self):
            setattr(self, field.name, getattr(saved, field.name))


class CountedEngine(Protocol):
    """What these functions read of an `Engine` (structural: this module does not import the engine)."""

    block_manager: Any
    scheduler: Any
    sampler: Any
    runner: Any
    policy_version: int
    counters: StepCounters


def engine_stats(engine: CountedEngine) -> dict[str, Any]:
    """The engine's counters (a snapshot): policy version, weight updates, queued and running samples, KV blocks,
    generated and prefilled tokens, prefix-cache hits, steps, preemptions, draft tokens (speculative decoding)."""
    blocks, scheduler, counters = engine.block_manager, engine.scheduler, engine.counters
    return {
        "policy_version": engine.policy_version,
        "weight_updates": counters.weight_updates,
        "queued": scheduler.num_waiting,
        "running": len(scheduler.running),
        "kv_blocks_used": blocks.num_used_blocks,
        "kv_blocks_free": blocks.num_free_blocks,
        "generated_tokens": counters.generated_tokens,
        "prefill_tokens": counters.prefill_tokens,
        "prefix_cache_hit_tokens": blocks.num_prefix_tokens_hit,
        "prefix_cache_query_tokens": blocks.num_prefix_tokens_queried,
        "steps": counters.steps,
        "preemptions": scheduler.num_preemptions,
        "preemptions_swapped": scheduler.num_swaps,
        # Speculative decoding: draft tokens computed, and those the verification accepted (0 without it).
        "draft_tokens": getattr(scheduler.drafter, "proposed_tokens", 0),
        "accepted_draft_tokens": getattr(scheduler.drafter, "accepted_tokens", 0),
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
