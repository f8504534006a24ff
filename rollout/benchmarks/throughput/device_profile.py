"""Where a run's time went: a short profile of it, the kernels a GPU spent its time in (on a CPU, the operators),
and how busy the device was over the run's wall time. `rollout-bench throughput` adds one to rollout's systems on a
GPU (`rollout` and `rollout_invariant`), so a figure that misses its goal comes with its profile, within the same
device call. Kernels replayed from CUDA graphs are traced one by one (CUPTI); their times have been reported less
reliable than eager kernels' on some CUDA versions (pytorch/kineto#1165): a guide to where time goes, not a timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

TOP = 12  # the entries kept, by time


def device_profile(run: Callable[[], Any], device: str, top: int = TOP) -> dict[str, Any]:
    """Run `run()` once under torch's profiler and summarise it.

    Args:
        run: what to profile (its result is dropped).
        device: "cuda" (the GPU's kernels, by device time) or "cpu" (the operators, by their own CPU time).
        top: how many of the kernels or operators to keep.
    Returns:
        wall_ms (the run, the device finished), busy_ms (the time in the kept kind: kernels on a GPU, operators on
        a CPU), busy_fraction (busy over wall: well under 1 on a GPU, the host keeps the device waiting), and
        `top` entries {name, ms, calls, share of busy_ms}, longest first.
    """
    on_gpu = device == "cuda"
    activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    if on_gpu:
        torch.cuda.synchronize()
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        run()
        if on_gpu:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    kind = DeviceType.CUDA if on_gpu else DeviceType.CPU
    entries = []
    for average in profiler.key_averages():
        if average.device_type != kind:
            continue
        # microseconds; a kernel's own time on its device, an operator's own time on the CPU
        spent = average.self_device_time_total if on_gpu else average.self_cpu_time_total
        entries.append((spent / 1e3, average.count, average.key))
    busy_ms = sum(ms for ms, _, _ in entries)
    entries.sort(reverse=True)
    return {
        "wall_ms": round(wall_ms, 2),
        "busy_ms": round(busy_ms, 2),
        # The profiler's clock is not perf_counter's: on a CPU, whose operators run back to back, their sum can pass
        # the wall time by a fraction of a percent (35.51 against 35.27 ms), never a real fraction above 1.
        "busy_fraction": min(1.0, round(busy_ms / wall_ms, 3)) if wall_ms else None,
        "top": [
            {"name": name[:120], "ms": round(ms, 3), "calls": calls, "share": round(ms / busy_ms, 3)}
            for ms, calls, name in entries[:top]
        ],
    }


def format_profile(system: str, summary: dict[str, Any]) -> list[str]:
    """The profile as lines for a benchmark's printed table (or the error that stopped it)."""
    if "error" in summary:
        return [f"{system} profile: failed: {summary['error']}"]
    lines = [
        f"{system} profile: {summary['wall_ms']:.1f} ms wall, {summary['busy_ms']:.1f} ms busy "
        f"({summary['busy_fraction']})"
    ]
    for entry in summary["top"]:
        lines.append(f"  {entry['ms']:>10.2f} ms {entry['share']:>6.1%} {entry['calls']:>7} calls  {entry['name']}")
    return lines
