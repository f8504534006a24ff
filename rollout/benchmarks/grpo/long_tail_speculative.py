"""`rollout-bench long-tail --speculative suffix`: the long-tail workload without and with speculative decoding, side by
side in one process, alternated `--repeats` times (a machine whose speed drifts then drifts for both alike).

Figures, each the median over the repeats, and the ratio of the two:
- tail forward passes per generated token: the forwards a sample sees per token it gets in the long tail (steps that
  decode at most 8 samples and compute nothing else): 1 without speculation, less when drafts are accepted;
- the tail's milliseconds per generated token, and its plain and drafted steps' mean milliseconds (each step's
  period, schedule to schedule: where a drafted step loses the overlap of host and device, it shows here), and of
  a drafted step the milliseconds it waited for the device (on a GPU its forward and sampling; the rest is host work);
- tokens per second over the whole run;
- the last sample's finish, from the round's start;
- on a CPU, the engine's host time: its steps' seconds outside the model's forward (the sampler's arithmetic
  included, which a GPU queues as kernels);
- draft tokens computed and accepted;
- with overlapped scheduling (a GPU's), the steps whose tokens came to the host before the next step was scheduled
  (drafted steps, and thin steps before one that may draft): their host work did not hide under the device's.
The same seeds give the same lengths and prompts to both; with `--known-lengths` every sample runs to its length.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

from rollout.benchmarks.harness.progress import stage

FIGURES = (
    "tail_forwards_per_token",
    "tail_ms_per_token",
    "tail_plain_step_ms",
    "tail_drafted_step_ms",
    "drafted_wait_ms",
    "tokens_per_s",
    "last_finish_s",
    "host_s",
    "draft_tokens",
    "accepted_draft_tokens",
    "verification_draws",
    "overlap_lost_steps",
)


def compare(
    measure_one: Callable[[str | None, float], dict[str, Any]],
    method: str,
    repeats: int,
    time_budget_s: float = float("inf"),
) -> dict[str, Any]:
    """Measure without and with speculative decoding, alternately, `repeats` times each, within `time_budget_s`.

    Args:
        measure_one: runs the workload once with the given `speculative` setting, stopping after the given seconds,
            and returns its summary.
        method: the speculative method ("suffix").
        repeats: runs of each.
        time_budget_s: for all the runs: each is given what is left, and a pair after the first starts only while
            the time left is at least what the pair before took.
    Returns:
        {"without": last plain summary, "with": last speculative summary, "medians": {figure: {"without", "with"}}
        over the pairs whose runs both finished (all runs when none did; None where no run has the figure),
        "ratios": {figure: with / without of the medians, None when no pair finished}, "repeats": the pairs run,
        "repeats_finished", "repeats_asked": repeats}. The plain run of a pair gets half the time left.
    """
    runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    deadline = time.monotonic() + time_budget_s
    last_pair_s = 0.0
    for repeat in range(repeats):
        started = time.monotonic()
        if repeat and deadline - started < last_pair_s:
            stage(f"long-tail: {repeat} of {repeats} pairs of runs fit the time budget")
            break
        for side, setting, share in (("without", None, 0.5), ("with", method, 1.0)):  # each side half the time
            stage(f"long-tail {side} speculative decoding, run {repeat + 1} of {repeats}")
            runs[side].append(measure_one(setting, max(share * (deadline - time.monotonic()), 0.0)))
            if runs[side][-1].get("interrupted"):
                break
        last_pair_s = time.monotonic() - started
        if runs[side][-1].get("interrupted"):  # Ctrl-C: no more runs; what finished is reported
            break
    # Only pairs whose runs both finished compare: a run cut short has done less of the workload, not the same.
    finished = [pair for pair in zip(runs["without"], runs["with"]) if all(run.get("finished") for run in pair)]
    chosen = {"without": [w for w, _ in finished], "with": [v for _, v in finished]} if finished else runs
    medians = {figure: {side: _median(run[figure] for run in chosen[side]) for side in chosen} for figure in FIGURES}
    ratios = {
        figure: round(values["with"] / values["without"], 4)
        if finished and values["with"] is not None and values["without"]
        else None
        for figure, values in medians.items()
    }
    stopped = {"interrupted": True} if any(run.get("interrupted") for run in runs["without"] + runs["with"]) else {}
    return {"without": runs["without"][-1], "with": runs["with"][-1] if runs["with"] else None, "medians": medians,
            "ratios": ratios, "repeats": len(runs["with"]), "repeats_finished": len(finished), "repeats_asked": repeats,
            **stopped}  # fmt: skip


def _median(values: Iterable[Any]) -> Any:
    """The median of the values a run has (a run cut short has no last sample; a GPU run no host time), else None."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def print_comparison(summary: dict[str, Any]) -> None:
    """The side-by-side table of `compare`'s summary."""
    names = {
        "tail_forwards_per_token": "tail forwards / token",
        "tail_ms_per_token": "tail ms / token",
        "tail_plain_step_ms": "tail plain step (ms)",
        "tail_drafted_step_ms": "tail drafted step (ms)",
        "drafted_wait_ms": "  waiting for device (ms)",
        "tokens_per_s": "tokens / s",
        "last_finish_s": "last sample (s)",
        "host_s": "engine host time (s)",
        "draft_tokens": "draft tokens",
        "accepted_draft_tokens": "accepted drafts",
        "verification_draws": "rounds drawn on device",
        "overlap_lost_steps": "steps not overlapped",
    }
    if summary.get("repeats_finished", summary["repeats"]) == 0:
        print("no pair of runs finished within the time budget: no ratio (the medians are of runs cut short)")
    elif summary.get("repeats_finished", summary["repeats"]) < summary["repeats"]:
        print(f"{summary['repeats_finished']} of {summary['repeats']} pairs finished: the medians are theirs")
    print(f"{'median of ' + str(summary['repeats']) + ' runs':<24}{'without':>12}{'with':>12}{'with/without':>14}")
    for figure, name in names.items():
        values, ratio = summary["medians"][figure], summary["ratios"][figure]
        shown = "" if ratio is None else f"{ratio:.3f}"
        cells = "".join(f"{'-' if values[side] is None else format(values[side], '.4g'):>12}" for side in values)
        print(f"{name:<24}{cells}{shown:>14}", flush=True)
