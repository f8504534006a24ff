"""`run`: the whole load. Starts the workers, forks the clients, optionally fuzzes the last worker from a thread,
collects every group, waits for the workers to drain, then stops everything and prints the summary's table."""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import tempfile
import threading
import time
from typing import Any

from rollout.benchmarks.load.clients import _client_main
from rollout.benchmarks.load.collect import _collect, _Progress
from rollout.benchmarks.load.rss import RssSampler
from rollout.benchmarks.load.summary import _print_table, _summarize
from rollout.benchmarks.load.workers import WorkerProcess, blocks_used, worker_stats


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the load (as the flags say), print the table and return the JSON-able summary (`passed` says whether
    nothing was lost or duplicated, no KV block stayed in use and a fuzzed worker still serves)."""
    from rollout.benchmarks import fuzz

    total = args.clients * args.groups
    flags = list(args.worker_arg)
    if args.num_blocks is not None:
        flags += ["--num-blocks", str(args.num_blocks)]
    log_dir = tempfile.mkdtemp(prefix="rollout-bench-load-")
    workers = [WorkerProcess(flags, log_dir, f"worker{i}") for i in range(args.workers)]
    addresses = [worker.address for worker in workers]
    settings = {
        "groups": args.groups,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "in_flight": args.in_flight,
        "seed": args.seed,
        "timeout": args.timeout,
        "dead_after": args.dead_after,
    }
    # Client processes are forked now, before this process has any thread or ZeroMQ context, and wait for `go`.
    mp = multiprocessing.get_context("fork")
    go = mp.Event()
    results = mp.Queue()
    clients = [
        mp.Process(target=_client_main, args=(i, addresses, settings, go, results), daemon=True)
        for i in range(args.clients)
    ]
    for process in clients:
        process.start()
    sampler: RssSampler | None = None
    fuzz_thread: threading.Thread | None = None
    fuzz_out: dict[str, Any] = {}
    progress = _Progress()
    final_stats: list[dict[str, Any] | None] = []
    drain_s = 0.0
    try:
        started = time.perf_counter()
        for worker in workers:
            worker.wait_ready()
        startup_s = time.perf_counter() - started
        sampler = RssSampler([worker.pid for worker in workers])
        target = workers[-1]  # the fuzz goes to the worker that is never killed
        if args.fuzz:
            fuzz_out["before"] = fuzz.check_serving(target.address, update_slot=False)
            cases = list(fuzz.fuzz_cases(args.fuzz, args.fuzz_seed))  # built before the clock starts
            live = fuzz.FuzzReport(target.address, args.fuzz_seed)
            fuzz_out["report"] = live
        go.set()
        start = time.perf_counter()
        if args.fuzz:

            def fire() -> None:
                fuzz.send_fuzz(target.address, args.fuzz, args.fuzz_seed, alive=target.alive, cases=cases, report=live)
                fuzz_out["finished"] = True

            fuzz_thread = threading.Thread(target=fire, name="fuzz", daemon=True)
            fuzz_thread.start()
        _collect(args, clients, results, workers, progress, total, start)
        load_s = time.perf_counter() - start
        if args.fuzz:
            fuzz_out["sent_during_load"] = live.sent
        if fuzz_thread is not None:
            fuzz_thread.join()
        fuzz_s = time.perf_counter() - start
        # Groups still in flight (a worker's copy of a group the client took away) must drain and free their blocks.
        drain_start = time.perf_counter()
        deadline = time.monotonic() + 30
        while True:
            final_stats = [None if w.killed else worker_stats(w.address) for w in workers]
            idle = all(
                s is None or (blocks_used(s) == 0 and not s.get("groups_in_flight"))
                for s, w in zip(final_stats, workers)
                if not w.killed
            )
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        drain_s = time.perf_counter() - drain_start
        sampler.sample()
        alive_end = [worker.alive() for worker in workers]
    finally:
        go.set()
        if sampler is not None:
            sampler.stop()
        for process in clients:
            process.join(5)
            if process.is_alive():
                process.kill()
        exit_codes = [worker.stop() for worker in workers]
    timings = {"load_s": load_s, "fuzz_s": fuzz_s, "drain_s": drain_s, "startup_s": startup_s}
    summary = _summarize(args, workers, progress, sampler, final_stats, fuzz_out, timings, exit_codes, alive_end)
    _print_table(summary)
    if summary["passed"]:
        shutil.rmtree(log_dir, ignore_errors=True)
    else:  # the workers' logs stay for a look
        for worker in workers:
            if not worker.killed:
                print(f"--- {worker.address} log ({worker.log_path}), last lines:\n{worker.log_tail()}")
    return summary
