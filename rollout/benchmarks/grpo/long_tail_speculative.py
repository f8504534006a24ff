"""`rollout-bench long-tail --speculative suffix`: the long-tail workload without and with speculative decoding, side by
side in one process, alternated `--repeats` times (a machine whose speed drifts then drifts for both alike).

Figures, each the median over the repeats, and the ratio of the two:
- tail forward passes per generated token: the forwards a sample sees per token it gets in the long tail (steps that
  decode at most 8 samples and compute nothing else): 1 without speculation, less when drafts are accepted;
- tokens per second over the whole run;
- the last sample's finish, from the round's start;
- on a CPU, the engine's host time: its steps' seconds outside the model's forward (what a GPU, whose forward of a
  small model costs little, would still pay per step);
- draft tokens computed and accepted.
The same seeds give the same lengths and prompts to both; with `--known-lengths` every sample runs to its length.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from rollout.benchmarks.harness.progress import stage

FIGURES = (
    "tail_forwards_per_token",
    "tokens_per_s",
    "last_finish_s",
    "host_s",
    "draft_tokens",
    "accepted_draft_tokens",
    "verification_draws",
)


def compare(measure_one: Callable[[str | None], dict[str, Any]], method: str, repeats: int) -> dict[str, Any]:
    """Measure without and with speculative decoding, alternately, `repeats` times each.

    Args:
        measure_one: runs the workload once with the given `speculative` setting and returns its summary.
        method: the speculative method ("suffix").
        repeats: runs of each.
    Returns:
        {"without": last plain summary, "with": last speculative summary, "medians": {figure: {"without", "with"}},
        "ratios": {figure: with / without of the medians}, "repeats": repeats}.
    """
    runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    for repeat in range(repeats):
        for side, setting in (("without", None), ("with", method)):
            stage(f"long-tail {side} speculative decoding, run {repeat + 1} of {repeats}")
            runs[side].append(measure_one(setting))
    medians = {
        figure: {side: statistics.median(run[figure] or 0 for run in runs[side]) for side in runs} for figure in FIGURES
    }
    ratios = {
        figure: round(values["with"] / values["without"], 4) if values["without"] else None
        for figure, values in medians.items()
    }
    return {"without": runs["without"][-1], "with": runs["with"][-1], "medians": medians, "ratios": ratios,
            "repeats": repeats}  # fmt: skip


def print_comparison(summary: dict[str, Any]) -> None:
    """The side-by-side table of `compare`'s summary."""
    names = {
        "tail_forwards_per_token": "tail forwards / token",
        "tokens_per_s": "tokens / s",
        "last_finish_s": "last sample (s)",
        "host_s": "engine host time (s)",
        "draft_tokens": "draft tokens",
        "accepted_draft_tokens": "accepted drafts",
        "verification_draws": "rounds drawn on device",
    }
    print(f"{'median of ' + str(summary['repeats']) + ' runs':<24}{'without':>12}{'with':>12}{'with/without':>14}")
    for figure, name in names.items():
        values, ratio = summary["medians"][figure], summary["ratios"][figure]
        shown = "" if ratio is None else f"{ratio:.3f}"
        print(f"{name:<24}{values['without']:>12.4g}{values['with']:>12.4g}{shown:>14}", flush=True)
