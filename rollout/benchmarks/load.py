"""`rollout-bench load`: many trainer processes against one or two `rollout-worker`s over loopback, counting every
group. Starts the workers (`python -m rollout.service.cli --model tiny ...`, each on a free port) and `--clients`
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

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

# Ids of the tiny preset's vocabulary (1024 tokens) that prompts are drawn from.
PROMPT_TOKENS = (10, 1000)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `rollout-bench load`."""
    add = parser.add_argument
    add("--clients", type=int, default=16, help="client processes (default: 16)")
    add("--groups", type=int, default=20, help="groups per client (default: 20)")
    add("--n", type=int, default=4, help="samples per group (default: 4)")
    add("--prompt-len", type=int, default=16, help="prompt tokens, random ids (default: 16)")
    add("--max-new-tokens", type=int, default=32, help="sampled tokens per sample, no stop token (default: 32)")
    add(
        "--in-flight",
        type=int,
        default=0,
        help="groups each client keeps in flight (default: 0, all of its groups at once)",
    )
    add("--workers", type=int, choices=(1, 2), default=1, help="rollout-worker processes (default: 1)")
    add("--kill-one", action="store_true", help="SIGKILL the first of two workers mid-run (needs --workers 2)")
    add(
        "--kill-at",
        type=float,
        default=0.25,
        help="with --kill-one: kill once this fraction of the groups has returned and the worker has groups in "
        "flight (default: 0.25; 0: as soon as it has some)",
    )
    add(
        "--dead-after",
        type=float,
        default=10.0,
        help="seconds a client waits on a silent worker before resubmitting its groups (default: 10)",
    )
    add("--fuzz", type=int, default=0, metavar="N", help="send N malformed messages during the load (default: 0)")
    add("--fuzz-seed", type=int, default=0, help="seed of the fuzzed messages (default: 0)")
    add("--seed", type=int, default=0, help="prompt and sampling seed (default: 0)")
    add("--timeout", type=float, default=600.0, help="seconds a client waits for any one group (default: 600)")
    add("--num-blocks", type=int, default=None, help="KV blocks per worker (default: the worker's)")
    add(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra rollout-worker argument, repeatable (e.g. --worker-arg=--max-num-seqs --worker-arg=64)",
    )


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors for impossible settings."""
    if min(args.clients, args.groups, args.n, args.prompt_len, args.max_new_tokens) < 1:
        parser.error("--clients, --groups, --n, --prompt-len and --max-new-tokens must be >= 1")
    if args.in_flight < 0 or args.fuzz < 0:
        parser.error("--in-flight and --fuzz must be >= 0")
    if args.kill_one and args.workers != 2:
        parser.error("--kill-one needs --workers 2 (the groups of the killed worker go to the other)")
    if not 0 <= args.kill_at < 1:
        parser.error("--kill-at must be in [0, 1)")


# ---- workers ------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class WorkerProcess:
    """A `rollout-worker` subprocess on a free loopback port, its output in a log file (never a pipe nobody reads:
    a worker that logs a lot would block on it)."""

    def __init__(self, flags: list[str] = (), log_dir: str | None = None, name: str = "worker"):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.log_path = os.path.join(log_dir or tempfile.gettempdir(), f"{name}-{os.getpid()}-{time.time_ns()}.log")
        command = [
            sys.executable,
            "-m",
            "rollout.service.cli",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--bind",
            self.address,
            "--log-level",
            "WARNING",
            *flags,
        ]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed by stop()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        self.killed = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Ping until the worker answers; a worker that exits first is an error naming its log."""
        import zmq

        from rollout.service import protocol as p

        context = zmq.Context()
        probe = context.socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        probe.connect(self.address)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if not self.alive():
                    raise RuntimeError(f"the rollout-worker on {self.address} exited: {self.log_tail()}")
                probe.send_multipart(p.encode(p.Ping(0)))
                if probe.poll(500):
                    return
            raise TimeoutError(f"no rollout-worker answered on {self.address}: {self.log_tail()}")
        finally:
            probe.close()
            context.term()

    def kill(self) -> None:
        self.killed = True
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL; returns the exit status."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def log_tail(self, size: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, os.path.getsize(self.log_path) - size))
                return log.read().decode(errors="replace")
        except OSError:
            return ""


def worker_stats(address: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """The worker's `stats` counters over a raw socket (None when it does not answer)."""
    import zmq

    from rollout.service import protocol as p

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(p.encode(p.Stats()))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        reply = p.decode(sock.recv_multipart())
        return reply.stats if isinstance(reply, p.StatsReply) else None
    finally:
        sock.close()
        context.term()


def blocks_used(stats: dict[str, Any] | None) -> int | None:
    """KV blocks in use according to a worker's stats."""
    if stats is None:
        return None
    if "kv_blocks_used" in stats:
        return stats["kv_blocks_used"]
    named = [value for key, value in stats.items() if "blocks_used" in key and isinstance(value, int)]
    return named[0] if named else None


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process (psutil when installed, else /proc/<pid>/status VmRSS)."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - the process is gone
        return None
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class RssSampler:
    """Samples the RSS of some processes every `period_s` in a thread: start (first sample), peak, last."""

    def __init__(self, pids: list[int], period_s: float = 0.2):
        self.pids = pids
        self.period_s = period_s
        self.first: dict[int, int | None] = {pid: rss_bytes(pid) for pid in pids}
        self.peak: dict[int, int] = {pid: v or 0 for pid, v in self.first.items()}
        self.last: dict[int, int | None] = dict(self.first)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        for pid in self.pids:
            value = rss_bytes(pid)
            self.last[pid] = value
            if value is not None:
                self.peak[pid] = max(self.peak[pid], value)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# ---- clients ------------------------------------------------------------------------------------------------------
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


# ---- the run ------------------------------------------------------------------------------------------------------
@dataclass
class _Progress:
    records: list[dict[str, Any]] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    kill: dict[str, Any] | None = None


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


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return ordered[rank]


def _summarize(
    args: argparse.Namespace,
    workers: list[WorkerProcess],
    progress: _Progress,
    sampler: RssSampler | None,
    final_stats: list[dict[str, Any] | None],
    fuzz_out: dict[str, Any],
    timings: dict[str, float],
    exit_codes: list[int | None],
    alive_end: list[bool],
) -> dict[str, Any]:
    load_s, fuzz_s, drain_s, startup_s = (timings[k] for k in ("load_s", "fuzz_s", "drain_s", "startup_s"))
    expected = {f"c{c}-g{g}" for c in range(args.clients) for g in range(args.groups)}
    returned: dict[str, int] = {}
    errors: dict[str, str] = {}
    bad: list[str] = []
    tokens = 0
    latencies = []
    for record in progress.records:
        if "returned_id" in record:
            group_id = record["returned_id"]
            returned[group_id] = returned.get(group_id, 0) + 1
            latencies.append(record["latency_s"])
            tokens += sum(record["lengths"])
            whole = (
                record["samples"] == list(range(args.n))
                and all(length == args.max_new_tokens for length in record["lengths"])
                and set(record["finish"]) <= {"length", "stop"}
                and record["prompt_ok"]
                and group_id == record["group_id"]
            )
            if not whole:
                bad.append(record["group_id"])
        elif record.get("group_id") is not None:
            errors[record["group_id"]] = record.get("error", "?")
    crashed = [r["client"] for r in progress.records if "crashed" in r]
    lost = sorted(expected - set(returned))
    duplicated = sorted(g for g, count in returned.items() if count > 1)
    unexpected = sorted(set(returned) - expected)
    ok_groups = len(set(returned) & expected)
    exactly_once = not (lost or duplicated or unexpected or bad or crashed)
    per_worker = []
    for index, worker in enumerate(workers):
        stats = final_stats[index] if index < len(final_stats) else None
        per_worker.append(
            {
                "address": worker.address,
                "killed": worker.killed,
                "died": not worker.killed and not alive_end[index],  # ended by itself before the run was over
                "exit_code": exit_codes[index],
                "rss_start_mb": _mb(sampler.first.get(worker.pid)) if sampler else None,
                "rss_peak_mb": _mb(sampler.peak.get(worker.pid)) if sampler else None,
                "rss_end_mb": None if worker.killed or sampler is None else _mb(sampler.last.get(worker.pid)),
                "kv_blocks_used_end": blocks_used(stats),
                "groups_in_flight_end": None if stats is None else stats.get("groups_in_flight"),
                "generated_tokens": None if stats is None else stats.get("generated_tokens"),
            }
        )
    live = [w for w in per_worker if not w["killed"]]
    blocks_clean = all(w["kv_blocks_used_end"] == 0 for w in live)
    summary: dict[str, Any] = {
        "benchmark": "load",
        "clients": args.clients,
        "groups_per_client": args.groups,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "in_flight_per_client": args.in_flight or args.groups,
        "workers": args.workers,
        "groups": len(expected),
        "groups_returned": ok_groups,
        "lost": len(lost),
        "duplicated": len(duplicated),
        "unexpected": len(unexpected),
        "malformed_results": len(bad),
        "crashed_clients": len(crashed),
        "exactly_once": exactly_once,
        "lost_ids": lost[:10],
        "errors": dict(list(errors.items())[:5]),
        "seconds": round(load_s, 2),
        "startup_s": round(startup_s, 2),
        "drain_s": round(drain_s, 2),
        "groups_per_s": round(ok_groups / load_s, 2) if load_s else None,
        "tokens_per_s": round(tokens / load_s, 1) if load_s else None,
        "generated_tokens": tokens,
        "latency_p50_s": _round(_percentile(latencies, 0.50)),
        "latency_p99_s": _round(_percentile(latencies, 0.99)),
        "latency_max_s": _round(max(latencies) if latencies else None),
        "kv_blocks_used_end": sum(w["kv_blocks_used_end"] or 0 for w in live) if live else None,
        "kv_blocks_clean": blocks_clean,
        "worker": per_worker,
        "kill": progress.kill,
    }
    died = [w["address"] for w in per_worker if w["died"]]
    summary["workers_died"] = died
    passed = exactly_once and blocks_clean and not died
    if args.kill_one and progress.kill is None:
        summary["kill"] = {"error": "no kill: the first worker had no group in flight after --kill-at"}
        passed = False
    report = fuzz_out.get("report")
    if args.fuzz:
        summary["fuzz_seconds"] = round(fuzz_s, 2)
        if report is None or not fuzz_out.get("finished"):
            summary["fuzz"] = {"error": "the fuzz thread did not finish"}
            passed = False
        else:
            fuzzed = report.to_dict(3)
            before = fuzz_out.get("before", {}).get("greedy_tokens")
            after = report.serving.get("greedy_tokens")
            fuzzed["greedy_unchanged"] = before is not None and before == after
            fuzzed["sent_during_load"] = fuzz_out.get("sent_during_load")
            summary["fuzz"] = fuzzed
            passed = passed and not report.worker_stopped and bool(report.serving.get("hello")) and after is not None
    summary["passed"] = passed
    return summary


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _print_table(summary: dict[str, Any]) -> None:
    s = summary
    print(
        f"load: {s['clients']} clients x {s['groups_per_client']} groups of n={s['n']} ({s['prompt_len']} prompt + "
        f"{s['max_new_tokens']} new tokens), {s['in_flight_per_client']} in flight per client, {s['workers']} "
        f"worker(s){', one killed' if s['kill'] else ''}{', fuzzed' if 'fuzz' in s else ''}"
    )
    rows = [
        ("groups returned", f"{s['groups_returned']}/{s['groups']}"),
        ("lost / duplicated", f"{s['lost']} / {s['duplicated']}"),
        ("unexpected / malformed", f"{s['unexpected']} / {s['malformed_results']}"),
        ("exactly once", "yes" if s["exactly_once"] else "NO"),
        ("seconds", f"{s['seconds']:.1f}"),
        ("groups/s", f"{s['groups_per_s']}"),
        ("tokens/s", f"{s['tokens_per_s']}"),
        ("latency p50 / p99 (s)", f"{s['latency_p50_s']} / {s['latency_p99_s']}"),
        ("KV blocks in use at end", f"{s['kv_blocks_used_end']}"),
    ]
    for worker in s["worker"]:
        rss = f"{worker['rss_start_mb']} / {worker['rss_peak_mb']} / {worker['rss_end_mb']} MB"
        rows.append((f"RSS start/peak/end {worker['address']}", rss + (" (killed)" if worker["killed"] else "")))
    if s["kill"] and "error" in s["kill"]:
        rows.append(("kill", s["kill"]["error"]))
    elif s["kill"]:
        k = s["kill"]
        killed = f"{k['at_s']} s, {k['after_groups_returned']} groups returned, {k['groups_in_flight_on_it']} in flight on it"
        rows.append(("killed at", killed))
    if "fuzz" in s and "sent" in s["fuzz"]:
        f = s["fuzz"]
        rows.append(("fuzz sent / answered", f"{f['sent']} / {f['answered']} ({f['error_replies']} errors)"))
        rows.append(("fuzz sent while the load ran", f"{f['sent_during_load']} (all in {s['fuzz_seconds']} s)"))
        rows.append(("fuzz unanswered", f"{f['unanswered']}"))
        serving = f["serving"]
        rows.append(
            (
                "fuzzed worker serves after",
                f"hello {'ok' if serving.get('hello') else 'FAILED'}, generate "
                f"{'ok' if serving.get('greedy_tokens') else 'FAILED'}, greedy unchanged {f['greedy_unchanged']}",
            )
        )
    if s["workers_died"]:
        rows.append(("workers that died", ", ".join(s["workers_died"])))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    failed = "FAILED: groups lost or duplicated, KV blocks left in use, a worker died or stopped serving"
    print("PASSED" if s["passed"] else failed)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (`python -m rollout.benchmarks.load`); `rollout-bench load` is the usual one."""
    parser = argparse.ArgumentParser(prog="rollout-bench load", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    summary = run(args)
    print(json.dumps(summary))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
