"""What a worker says about itself: `hello`'s answer (what it serves) and its counters (`stats`, which the `stats`
message, `RolloutClient.stats()` and the /metrics scrape all read)."""

from __future__ import annotations

import dataclasses
from typing import Any

from rollout import protocol as p
from rollout.engine.manager.continuous_batching import ContinuousBatchingManager
from rollout.service.group_counters import GroupCounters
from rollout.service.weights.update_slot import UpdateSlot
from rollout.service.zmq.clients import ClientLinks


def hello_reply(manager: ContinuousBatchingManager, model_name: str, tokenizer_name: str | None) -> p.HelloReply:
    """`hello`'s answer.

    Args:
        manager: the worker's engine manager (its config, vocabulary, longest sequence and policy version).
        model_name: the served model's name.
        tokenizer_name: where the engine's tokenizer came from (None: none).
    """
    engine = manager.engine
    config = dataclasses.asdict(manager.config)
    return p.HelloReply(
        model_name, engine.vocab_size, engine.max_model_len, engine.policy_version, config, tokenizer_name
    )


def worker_stats(
    manager: ContinuousBatchingManager,
    links: ClientLinks,
    counters: GroupCounters,
    updates: UpdateSlot,
    tokenizer_name: str | None,
) -> dict[str, Any]:
    """The manager's counters plus the worker's: policy version, groups received / refused / in flight / finished,
    samples finished by reason, clients (seen, lost, dropped for not reading), reply bytes waiting for slow clients,
    weight updates rejected, their bytes and pauses, tokens/s since start, served adapters, and whether the engine
    runs batch-invariant and with fp32 logits, its context (`max_model_len`: prompt + completion tokens), on which device ("cpu", "cuda") and in which dtype ("bfloat16", ...).
    Safe from any thread (the /metrics scrape reads it).

    Args:
        manager: the worker's engine manager.
        links: its clients' links.
        counters: its group counters.
        updates: its weight-update slot.
        tokenizer_name: where the engine's tokenizer came from (None: none).
    """
    stats = manager.stats()
    engine = manager.engine
    uptime = max(stats["uptime_s"], 1e-9)
    stats.update(
        policy_version=engine.policy_version,
        clients=links.num_clients,
        clients_lost=links.num_lost,
        pending_reply_bytes=links.pending_bytes(),
        peak_pending_reply_bytes=links.peak_pending_bytes,
        clients_dropped_unread=links.dropped_slow,
        **counters.snapshot(),
        weight_updates_rejected=updates.counts.rejected,
        weight_update_bytes=updates.counts.bytes_committed,
        weight_update_pause_ms=updates.counts.pause_ms_total,
        tokens_per_s=stats["generated_tokens"] / uptime,
        tokenizer=tokenizer_name,
        adapters=engine.runner.adapters.stats(),
        base_id=updates.base.base_id,
        batch_invariant=engine.config.batch_invariant,
        fp32_logits=engine.config.fp32_logits,
        max_model_len=engine.max_model_len,
        device=engine.kv_cache.kv.device.type,
        dtype=str(engine.kv_cache.kv.dtype).removeprefix("torch."),
    )
    return stats
