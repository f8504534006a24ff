"""`rollout-bench service --agentic`: what prefix-affine routing saves an agent on a fleet. A synthetic agent runs
`episodes` conversations of `turns` turns through one `RolloutClient` over `workers` rollout-worker subprocesses
(the tiny preset): each turn sends the conversation so far (a system prompt, then every earlier completion and tool
result, as token ids), samples a completion, and appends it and a tool result of random tokens. All episodes take
each turn together, so the client spreads them over the workers by load.

The figure: prompt tokens the workers computed (prompt length - `cached_prompt_tokens`, what the prefix cache did
not give) / new tokens (what the turn appended: the last completion and tool result), over turns 2 and later. With
every earlier token's KV cached it is 1.0 or less (less: the completion's own KV, computed while it was generated,
is cached too, in whole blocks), plus up to one block for the partial block the cache cannot share; it rises to
about prompt length / new tokens when a turn lands on a worker that never saw its conversation. Measured with affinity (`affinity_slack=4`, the default) and
without (`affinity_slack=None`: load alone); the goal is at most 1.2 with it. Each run uses its own random tokens,
so the second finds nothing of the first in the caches.
"""

from __future__ import annotations

import random
import subprocess
import time
from typing import Any

from rollout.benchmarks.harness.worker_probe import free_port, stop_workers, wait_answering, worker_command

GOAL = 1.2
VOCAB = range(4, 1000)  # token ids of the tiny preset, its special tokens left out


def run(turns: int = 10, episodes: int = 16, workers: int = 2, system: int = 256, new: int = 32, seed: int = 0) -> dict:
    """Start the workers, run the agent with and without affinity, stop them; return the JSON-able summary (each
    run's line is printed as it finishes).

    Args:
        turns: turns per episode (at least 2).
        episodes: conversations run side by side.
        workers: rollout-worker subprocesses.
        system: the system prompt's tokens.
        new: tokens of each completion, and of each tool result.
        seed: random tokens' seed.
    """
    if turns < 2 or episodes < 1 or workers < 1 or system < 1 or new < 1:
        raise ValueError("--turns must be >= 2; --episodes, --workers, system and new tokens >= 1")
    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(workers)]
    blocks = 4 * episodes * (system + 2 * new * turns) // 16 + 64  # every conversation's KV fits twice over
    flags = ["--num-blocks", str(blocks), "--block-size", "16"]
    processes = [subprocess.Popen(worker_command(address, flags)) for address in addresses]
    summary: dict[str, Any] = {"turns": turns, "episodes": episodes, "workers": workers, "goal": GOAL}
    try:
        for process, address in zip(processes, addresses):
            wait_answering(address, 120, lambda p=process: None if p.poll() is None else f"status {p.returncode}")
        for name, slack in (("with_affinity", 4.0), ("without_affinity", None)):
            summary[name] = _agent(addresses, slack, turns, episodes, system, new, random.Random(f"{seed}-{name}"))
            line = summary[name]
            print(
                f"{name:17s} computed/new prompt tokens {line['ratio']:.2f} (turns 2+), "
                f"per turn {line['per_turn']}, {line['seconds']:.1f} s",
                flush=True,
            )
    finally:
        stop_workers(processes, 30)
    summary["passed"] = summary["with_affinity"]["ratio"] <= GOAL
    return summary


def _agent(
    addresses: list[str], slack: float | None, turns: int, episodes: int, system: int, new: int, rng: random.Random
) -> dict:
    """One run of the agent; per turn (from the second), computed / new prompt tokens over all episodes."""
    from trainer_bridge import PromptGroup, RolloutClient

    sampling = {"max_new_tokens": new, "stop_token_ids": [], "seed": 0}
    conversations = [[rng.choice(VOCAB) for _ in range(system)] for _ in range(episodes)]
    appended = [len(c) for c in conversations]
    computed_total = new_total = 0
    per_turn: list[float] = []
    started = time.perf_counter()
    with RolloutClient(addresses, timeout=600, affinity_slack=slack) as client:
        for turn in range(turns):
            groups = [PromptGroup(list(c), 1, dict(sampling), f"e{i}-t{turn}") for i, c in enumerate(conversations)]
            rng.shuffle(groups)  # turns arrive in no particular order (as tool calls finish)
            results = client.generate_many(groups)
            computed = fresh = 0
            for result in results:
                index = int(result.group_id[1:].split("-")[0])
                (completion,) = result.completions
                computed += len(conversations[index]) - completion.cached_prompt_tokens
                fresh += appended[index]
                tool_result = [rng.choice(VOCAB) for _ in range(new)]
                conversations[index] += completion.token_ids + tool_result
                appended[index] = len(completion.token_ids) + len(tool_result)
            if turn:
                per_turn.append(round(computed / fresh, 2))
                computed_total += computed
                new_total += fresh
    return {"ratio": computed_total / new_total, "per_turn": per_turn, "seconds": time.perf_counter() - started}
