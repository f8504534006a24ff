"""Taking the client processes' records as they come (`_Progress`), and SIGKILLing a worker that has groups in flight
on the way (`--kill-one`)."""

from __future__ import annotations

import argparse
import math
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from rollout.benchmarks.load.workers import WorkerProcess, worker_stats


@dataclass
class _Progress:
    records: list[dict[str, Any]] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    kill: dict[str, Any] | None = None


def _collect(
    args: argparse.Namespace,
    clients: list,
    results: Any,
    workers: list[WorkerProcess],
    progress: _Progress,
    total: int,
    start: float,
) -> None:
    """Take the client processes' records until every client is done (or died); kill a worker on the way."""
    kill_after = math.ceil(args.kill_at * total) if args.kill_one else None
    while len(progress.done) < len(clients):
        returned = sum(1 for r in progress.records if "returned_id" in r)
        if kill_after is not None and progress.kill is None and returned >= kill_after:
            progress.kill = _kill_if_busy(workers[0], returned, start)
        try:
            item = results.get(timeout=0.2)
        except queue.Empty:
            for index, process in enumerate(clients):
                if index not in progress.done and not process.is_alive():
                    try:  # its last records may still be in the pipe
                        while True:
                            _take(results.get(timeout=1.0), progress)
                    except queue.Empty:
                        pass
                    if index not in progress.done:
                        progress.done.add(index)
                        progress.records.append({"client": index, "group_id": None, "crashed": process.exitcode})
            continue
        _take(item, progress)


def _kill_if_busy(victim: WorkerProcess, returned: int, start: float) -> dict[str, Any] | None:
    """SIGKILL a worker that has groups in flight (None, and no kill, while it has none); what it had in flight
    just before (from its stats)."""
    stats = worker_stats(victim.address, 2.0)
    if stats is not None and not stats.get("groups_in_flight"):
        return None
    victim.kill()
    return {
        "worker": victim.address,
        "after_groups_returned": returned,
        "at_s": round(time.perf_counter() - start, 2),
        "groups_in_flight_on_it": None if stats is None else stats.get("groups_in_flight"),
        "running_on_it": None if stats is None else stats.get("running"),
        "queued_on_it": None if stats is None else stats.get("queued"),
    }


def _take(item: Any, progress: _Progress) -> None:
    if isinstance(item, tuple) and item and item[0] == "done":
        progress.done.add(item[1])
    else:
        progress.records.append(item)
