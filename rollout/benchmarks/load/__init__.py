"""`rollout-bench load`: many trainer processes against one or two `rollout-worker`s over loopback, counting every
group. Starts the workers (`python -m rollout.service.launch.cli --model tiny ...`, each on a free port) and `--clients`
client processes (each a `RolloutClient` given every worker's address), each generating `--groups` groups of `--n`
samples (random prompts of `--prompt-len` tokens, `--max-new-tokens` sampled tokens and no stop token, so every
sample has exactly that many tokens). Reports groups/s, tokens/s, p50/p99 group latency (submit to result),
exactly-once (every group id returned once, with n completions of the right length: none lost, none duplicated),
each worker's RSS (start, peak, end; sampled every 0.2 s) and the KV blocks still in use at the end (from the
worker's `stats`, after its groups drained; must be 0).

`--workers 2 --kill-one` SIGKILLs the first worker once `--kill-at` of the groups have returned and it has groups in
flight: its clients declare it dead after `--dead-after` s and resubmit its groups to the other, and nothing may be
lost. `--fuzz N` sends N malformed messages (`rollout.benchmarks.fuzz`, built before the clock starts) from raw
DEALER sockets to the last worker (never the killed one) while the load runs, and reports how many were answered
and whether that worker still serves afterwards (hello, the same greedy tokens as before, a free update slot).

Prints a table, then one line of JSON; exits non-zero when a group was lost or duplicated, KV blocks remain in use,
a worker died by itself, a fuzzed worker stopped serving, or `--kill-one` found no group in flight to kill.
"""

# Files (the docstring above is the `--help` text, so they are listed here):
#
# - `arguments.py`: the flags of `rollout-bench load` and the usage errors for impossible settings.
# - `workers.py`: `WorkerProcess` (a `rollout-worker` subprocess on a free loopback port, logging to a file),
#   `worker_stats` and `blocks_used` (its `stats` over a raw socket, KV blocks in use).
# - `rss.py`: `rss_bytes` and `RssSampler` (the workers' resident memory: start, peak, last).
# - `clients.py`: one client process (its groups through one `RolloutClient`), the prompts and sampling seeds.
# - `collect.py`: taking the clients' records as they come, and killing a busy worker on the way (`--kill-one`).
# - `runner.py`: `run`, the whole load: workers, forked clients, the optional fuzz thread, the drain, the cleanup.
# - `summary.py`: the JSON-able summary (exactly-once, latencies, memory, KV blocks, fuzz) and its table.
# - `__main__.py`: `python -m rollout.benchmarks.load`, which runs `main` below.

from __future__ import annotations

import json

from rollout.benchmarks.load.arguments import add_arguments, check_arguments
from rollout.benchmarks.load.clients import PROMPT_TOKENS, rng_seed
from rollout.benchmarks.load.rss import RssSampler, rss_bytes
from rollout.benchmarks.load.runner import run
from rollout.benchmarks.load.workers import WorkerProcess, blocks_used, free_port, worker_stats
from rollout.cli.parser import CliParser

__all__ = [
    "PROMPT_TOKENS",
    "RssSampler",
    "WorkerProcess",
    "add_arguments",
    "blocks_used",
    "check_arguments",
    "free_port",
    "main",
    "rng_seed",
    "rss_bytes",
    "run",
    "worker_stats",
]


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (`python -m rollout.benchmarks.load`); `rollout-bench load` is the usual one."""
    parser = CliParser(prog="rollout-bench load", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    summary = run(args)
    print(json.dumps(summary))
    return 0 if summary["passed"] else 1
