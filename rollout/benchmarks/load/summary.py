"""The summary of a load run: exactly-once accounting (lost, duplicated, malformed groups), throughput and latency,
each worker's memory and KV blocks left, the fuzz's figures, whether it passed; and the table printed before it."""

from __future__ import annotations

import argparse
import math
from typing import Any

from rollout.benchmarks.load.collect import _Progress
from rollout.benchmarks.load.rss import RssSampler
from rollout.benchmarks.load.workers import WorkerProcess, blocks_used


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
