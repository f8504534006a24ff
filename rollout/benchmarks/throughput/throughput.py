"""`rollout-bench throughput`: generated tokens/s of this engine vs transformers' `generate_batch` (continuous
batching) and `generate` (one left-padded static batch), on the same model and prompts.

Each system runs in a process of its own (`isolated.py`), warmed up before its timer starts, with the workload's
KV budget in bytes and its own time limit; its result is printed as one JSON line as soon as it finishes, and a
system that fails or runs out of time is reported as such while the others still run. The systems themselves are in
`systems.py`, the workloads in `workloads.py`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rollout.benchmarks.harness.isolated import run_system
from rollout.benchmarks.harness.progress import stage
from rollout.benchmarks.harness.section_run import SectionInterrupted
from rollout.benchmarks.harness.workloads import WORKLOADS
from rollout.benchmarks.throughput.device_profile import format_profile
from rollout.benchmarks.throughput.systems import STOP_AT_DEADLINE

# Of a system's time limit, what a baseline leaves itself to stop at its deadline and print what it finished: 15 s,
# or a quarter of a shorter limit (a margin longer than the limit would stop it before it started).
STOP_MARGIN_S = 15.0
STOP_MARGIN_SHARE = 0.25
# Under a time budget, the details count as half a system when the systems' shares are set: a system's figure is
# the headline, the details come after it and also get whatever time the systems leave.
DETAILS_WEIGHT = 0.5


def run(
    workload_name: str,
    systems: list[str] | None = None,
    seed: int = 0,
    repeats: int = 1,
    details: bool = False,
    warmup: bool = True,
    num_prompts: int | None = None,
    system_timeout_s: float | None = None,
    time_budget_s: float | None = None,
    batch_invariant: bool = False,
) -> dict:
    """Run the workload on each system, each in its own process, and return the JSON-able summary (also printed as a
    table).

    Args:
        workload_name: a key of WORKLOADS.
        systems: which systems to run (default: the workload's `default_systems`).
        seed: model and prompt seed.
        repeats: timed runs per system; the median time is reported.
        details: add `rollout.benchmarks.throughput.details` figures (decode roofline fraction, peak memory, logprob
            fidelity against the trainer's own floor, host time per step), measured in one more process.
        warmup: warm each system up before its timer starts (graphs captured, kernels compiled).
        num_prompts: run this many of the workload's requests (the first ones; default: all).
        system_timeout_s: each system's own time limit (default: the workload's).
        time_budget_s: the most seconds the whole run may take: each system gets at most an equal share of what is
            left when it starts (the details count as half a system, and get all that is left), so time a fast
            system leaves over goes to the later ones.
        batch_invariant: also run `rollout_invariant` right after `rollout` (added first if `rollout` is not run).
    """
    workload = WORKLOADS[workload_name]
    if workload.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"workload {workload_name!r} needs a CUDA device")
    timeout = system_timeout_s or workload.system_timeout_s
    options = dict(workload=workload_name, seed=seed, repeats=repeats, warmup=warmup, num_prompts=num_prompts)
    count = min(num_prompts or workload.num_prompts, workload.num_prompts)
    stage(f"throughput {workload_name}: {count} prompts, KV budget {workload.kv_budget_bytes() / 2**30:.2f} GiB each")
    results: dict[str, dict[str, Any]] = {}
    reference = None
    names = list(systems or workload.default_systems)
    if batch_invariant and "rollout_invariant" not in names:
        names.insert(names.index("rollout") + 1 if "rollout" in names else 0, "rollout_invariant")
    deadline = None if time_budget_s is None else time.monotonic() + time_budget_s

    def share(runs_left: float) -> float:
        return timeout if deadline is None else max(1.0, min(timeout, (deadline - time.monotonic()) / runs_left))

    interrupted = False
    for index, name in enumerate(names):
        limit = share(len(names) - index + DETAILS_WEIGHT * details)
        # A baseline stops itself a little before its process is killed, to report what it finished (`cut_short`).
        margin = min(STOP_MARGIN_S, STOP_MARGIN_SHARE * limit)
        stop_at = {"deadline": time.monotonic() + limit - margin} if name in STOP_AT_DEADLINE else {}
        try:
            result = run_system("throughput", name, {**options, **stop_at}, limit)
        except SectionInterrupted as stopped:  # Ctrl-C or SIGTERM: the system was killed; report what finished
            interrupted = True
            results[name] = {"system": name, "status": "interrupted", "seconds": round(stopped.result.seconds, 1)}
            break
        digests = result.pop("token_digests", None)
        if digests is not None:
            reference = reference or digests
            result["identical_to_first"] = sum(a == b for a, b in zip(digests, reference))
        results[name] = result
    summary = {
        "benchmark": "throughput",
        "workload": workload_name,
        "device": workload.device,
        # The workload's tokens: a system's that ran it whole (one cut short generated fewer).
        "generated_tokens": next(
            (r["generated_tokens"] for r in results.values() if "generated_tokens" in r and not r.get("cut_short")),
            None,
        ),
        "num_prompts": count,
        "repeats": repeats,
        "warmup": warmup,
        "kv_budget_bytes": workload.kv_budget_bytes(),
        "torch_threads": torch.get_num_threads(),
        "results": results,
    }
    if interrupted:
        summary["interrupted"] = True  # `rollout-bench` prints it, then exits 130
    rollout = results.get("rollout", {}).get("tokens_per_s")
    for name, result in results.items():
        if name != "rollout" and rollout and result.get("tokens_per_s"):
            summary[f"speedup_vs_{name}"] = round(rollout / result["tokens_per_s"], 2)
    if details and not interrupted:
        stage("details: instrumented runs")
        options = dict(workload=workload_name, seed=seed, num_prompts=num_prompts)
        try:
            summary["details"] = run_system("details", "rollout", options, share(1))
        except SectionInterrupted as stopped:
            summary["interrupted"] = True
            summary["details"] = {"status": "interrupted", "seconds": round(stopped.result.seconds, 1)}
    _print_table(summary)
    return summary


def _print_table(summary: dict) -> None:
    generated = summary["generated_tokens"]
    print(
        f"workload {summary['workload']}: {summary['num_prompts']} prompts, "
        f"{'?' if generated is None else generated} generated tokens, median of {summary['repeats']} run(s), "
        f"KV budget {summary['kv_budget_bytes'] / 2**30:.2f} GiB per system, {summary['torch_threads']} torch threads"
    )
    # rollout's tokens/s over the system's: 1.78x means rollout was 1.78 times as fast (below 1x: slower)
    print(f"{'system':<30}{'seconds':>10}{'tokens/s':>12}{'rollout is':>14}{'same tokens':>13}{'warm-up s':>11}")
    rollout = summary["results"].get("rollout", {}).get("tokens_per_s")
    for name, result in summary["results"].items():
        if result["status"] != "ok":
            print(f"{name:<30}{result['status'].upper()} after {result['seconds']:.0f} s (see its output above)")
            continue
        ratio = f"{rollout / result['tokens_per_s']:.2f}x as fast" if rollout and result["tokens_per_s"] else ""
        same = f"{result.get('identical_to_first', 0)}/{summary['num_prompts']}"
        print(
            f"{name:<30}{result['seconds']:>10.2f}{result['tokens_per_s']:>12.1f}{ratio:>14}{same:>13}"
            f"{result['warmup_s']:>11.1f}"
        )
        cut = result.get("cut_short")
        if cut:
            print(
                f"  {name} was CUT SHORT at its time limit: {cut['finished_requests']} of {cut['requests']} requests "
                f"finished, {cut['tokens']} of {cut['requested_tokens']} tokens counted in {result['seconds']:.1f} s"
            )
    for name, result in summary["results"].items():
        if result.get("profile"):
            print("\n".join(format_profile(name, result["profile"])))
    details = summary.get("details")
    if details and details["status"] != "ok":
        print(f"details: {details['status'].upper()} after {details['seconds']:.0f} s (see its output above)")
    elif details:
        print(
            f"decode roofline fraction {details['decode_roofline_fraction']:.3f} (device copy bandwidth "
            f"{details['device_bandwidth_gb_per_s']} GB/s, median decode step {details['median_decode_step_ms']} ms), "
            f"peak memory {details['peak_memory_gib']} GiB"
        )
        for key in ("default", "fp32_logits"):
            row = details[key]
            print(
                f"logprob |rollout - teacher-forced| ({key}, model at {details['entropy_nats']} nats): mean "
                f"{row['logprob_abs_diff_mean']:.2e}, p99 {row['logprob_abs_diff_p99']:.2e}; the trainer's own floor "
                f"(padded batch vs one sequence): mean {row['floor_abs_diff_mean']:.2e}, p99 "
                f"{row['floor_abs_diff_p99']:.2e}: {'within' if row['within_floor'] else 'ABOVE'} it"
            )
