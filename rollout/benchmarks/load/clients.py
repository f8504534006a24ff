"""One client process of the load: its groups (random prompts, seeded sampling) through one `RolloutClient`, every
outcome sent back to the run as a record."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

# Ids of the tiny preset's vocabulary (1024 tokens) that prompts are drawn from.
PROMPT_TOKENS = (10, 1000)


def _client_main(
    index: int,
    addresses: list[str],
    settings: dict[str, Any],
    go: Any,
    results: Any,
) -> None:
    """One client process: `groups` groups through one RolloutClient, `in_flight` at a time; every outcome (result or
    error) goes to `results` as a dict, then ("done", index)."""
    from trainer_bridge import PromptGroup, RolloutClient, RolloutError

    rng = random.Random(f"{settings['seed']}/{index}")
    groups = settings["groups"]
    prompts = [[rng.randrange(*PROMPT_TOKENS) for _ in range(settings["prompt_len"])] for _ in range(groups)]
    sampling = {"temperature": 1.0, "max_new_tokens": settings["max_new_tokens"], "stop_token_ids": []}
    go.wait()
    client = RolloutClient(addresses, timeout=settings["timeout"], dead_after_s=settings["dead_after"])
    order = iter(range(groups))
    lock = threading.Lock()

    def run() -> None:
        while True:
            with lock:
                g = next(order, None)
            if g is None:
                return
            group_id = f"c{index}-g{g}"
            group = PromptGroup(prompts[g], settings["n"], {**sampling, "seed": rng_seed(index, g)}, group_id)
            start = time.perf_counter()
            record: dict[str, Any] = {"client": index, "group_id": group_id}
            try:
                result = client.generate(group)
                record.update(
                    returned_id=result.group_id,
                    latency_s=time.perf_counter() - start,
                    samples=sorted(c.sample_index for c in result.completions),
                    lengths=[len(c.token_ids) for c in result.completions],
                    finish=sorted({c.finish_reason for c in result.completions}),
                    prompt_ok=list(result.prompt_ids) == prompts[g],
                )
            except RolloutError as error:
                record.update(error=f"{error.code}: {error}", latency_s=time.perf_counter() - start)
            except Exception as error:  # noqa: BLE001 - reported, never silently lost
                record.update(error=f"{type(error).__name__}: {error}", latency_s=time.perf_counter() - start)
            results.put(record)

    threads = [threading.Thread(target=run) for _ in range(min(settings["in_flight"] or groups, groups))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        client.close()
        results.put(("done", index))


def rng_seed(client: int, group: int) -> int:
    """The sampling seed of a group (a resubmitted group reproduces its tokens)."""
    return (client * 1_000_003 + group) % (2**62)
