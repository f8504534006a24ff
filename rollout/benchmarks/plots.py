"""`rollout-bench ... --plot FILE.png`: the summary a subcommand prints as its last JSON line, drawn as a PNG.

One function per subcommand (`plot_throughput`, `plot_grpo_step`, `plot_long_tail`), each taking that summary dict as
it is, and one saver. matplotlib is imported only here and only when a plot is asked for, through its Agg canvas
directly: no pyplot, no global backend switched, no window. `check_plot_request` runs before the benchmark, so a long
run is never lost to a bad path or a missing package.
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout.cli.extras import MissingExtra, require_extra

FIGURE_SIZE_IN = (7.0, 4.0)
DPI = 100  # 700 x 400 pixels: a few tens of KB
# The split of one GRPO step, bottom to top, with its colour.
STEP_PARTS = (("generation_s", "generation", "#4c72b0"), ("weight_sync_s", "weight sync", "#dd8452"))
STEP_PARTS += (("training_s", "training", "#55a868"),)


def add_plot_argument(parser: argparse.ArgumentParser, chart: str) -> None:
    """The --plot flag of a subcommand whose summary this module draws.

    Args:
        parser: the subcommand's parser.
        chart: what the PNG shows, for the help text.
    """
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help=f"also draw the results as a PNG (matplotlib, 7x4 in at 100 dpi): {chart}; the path is checked before "
        "the run (needs matplotlib: pip install 'rollout[docs]'; default: no plot)",
    )


def check_plot_request(path: str) -> Path:
    """Refuse, in one line, a --plot that could not be drawn, before any benchmark runs.

    Args:
        path: the FILE.png given to --plot.
    Returns:
        The path.
    Raises:
        ValueError: the path cannot take a PNG (`check_output_path`).
        MissingExtra: matplotlib is not installed, or does not import (an ImportError naming
            `pip install 'rollout[docs]'`).
    """
    target = check_output_path(path)
    require_extra("docs", "--plot")
    try:  # installed is not enough: a broken install (a numpy it was not built for) must fail now, not after the run
        import matplotlib.backends.backend_agg  # noqa: F401
        import matplotlib.figure  # noqa: F401
    except ImportError as error:
        raise MissingExtra(f"--plot: matplotlib does not import ({error}): pip install 'rollout[docs]'") from None
    return target


def check_output_path(path: str) -> Path:
    """Refuse, in one line, a --plot path that cannot take a PNG, before any benchmark runs.

    Args:
        path: the FILE.png given to --plot.
    Returns:
        The path.
    Raises:
        ValueError: not ending in .png, a folder, a folder that does not exist, or not writable.
    """
    target = Path(path).expanduser()
    folder = target.parent
    if target.suffix.lower() != ".png":
        raise ValueError(f"--plot {path}: the plot is a PNG, give a path ending in .png")
    if target.is_dir():
        raise ValueError(f"--plot {path}: is a folder, give a file name ending in .png")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--plot {path}: {folder} is not a folder")
    if not folder.is_dir():
        raise ValueError(f"--plot {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"--plot {path}: not writable")
    return target


def save_figure(figure: Any, path: str | Path) -> Path:
    """Write `figure` as a PNG at `DPI` through the Agg canvas.

    Args:
        figure: a `matplotlib.figure.Figure`.
        path: where the PNG goes (its folder must exist).
    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    figure.savefig(path, format="png", dpi=DPI, metadata={"Software": None})
    return Path(path)


def _new_figure(columns: int = 1) -> tuple[Any, list[Any]]:
    """A `FIGURE_SIZE_IN` figure (no pyplot) with `columns` axes side by side."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIGURE_SIZE_IN, layout="constrained")
    axes = figure.subplots(1, columns, squeeze=False)[0]
    return figure, list(axes)


def _today(date: str | None) -> str:
    return date or datetime.date.today().isoformat()


def _failed_label(axes: Any, x: float, text: str) -> None:
    """Write what happened to a system with no figure where its bar would stand."""
    axes.annotate(text, (x, 0), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom", fontsize=8)


def plot_throughput(summary: dict[str, Any], path: str | Path, date: str | None = None) -> Path:
    """Bar chart of `rollout-bench throughput`: generated tokens/s per system, the median run, with whiskers from the
    slowest to the fastest run (`runs_s`) when there were several.

    Args:
        summary: the subcommand's summary (`throughput.run`).
        path: the PNG to write.
        date: the date in the title (default: today).
    Returns:
        The path written.
    """
    figure, (axes,) = _new_figure()
    names = list(summary["results"])
    for x, name in enumerate(names):
        result = summary["results"][name]
        if result.get("status") != "ok":
            _failed_label(axes, x, result.get("status", "failed").upper())
            continue
        median = result["tokens_per_s"]
        per_run = [result["generated_tokens"] / seconds for seconds in result.get("runs_s") or [] if seconds > 0]
        # max(0, ...): the median is rounded, so runs of equal length could give a whisker of -0.01
        errors = [[max(0.0, median - min(per_run))], [max(0.0, max(per_run) - median)]] if len(per_run) > 1 else None
        axes.bar(x, median, color="#4c72b0" if name.startswith("rollout") else "#8c8c8c", yerr=errors, capsize=6)
        axes.annotate(
            f"{median:,.0f}", (x, median), xytext=(-5, 3), textcoords="offset points", ha="right", fontsize=9
        )  # left of the whisker
    axes.set_xticks(range(len(names)), [name.replace("transformers_", "transformers\n") for name in names])
    axes.set_ylabel("generated tokens/s")
    axes.margins(y=0.15)
    runs = f"median of {summary['repeats']} runs, min-max whiskers" if summary["repeats"] > 1 else "one run"
    device = summary.get("device", "")
    axes.set_title(
        f"throughput: workload {summary['workload']}, {device} ({summary['torch_threads']} torch threads), "
        f"{_today(date)}\n{summary['num_prompts']} prompts, {summary['generated_tokens']} tokens, {runs}",
        fontsize=10,
    )
    return save_figure(figure, path)


def plot_grpo_step(summary: dict[str, Any], path: str | Path, date: str | None = None) -> Path:
    """Stacked bars of `rollout-bench grpo-step`: median seconds per step of each system (or each --max-staleness /
    --partial-rollouts run), split into generation, weight sync and training.

    Args:
        summary: the subcommand's summary (`grpo_step.run`).
        path: the PNG to write.
        date: the date in the title (default: today).
    Returns:
        The path written.
    """
    figure, (axes,) = _new_figure()
    names = list(summary["results"])
    for x, name in enumerate(names):
        row = summary["results"][name]
        if "error" in row:
            _failed_label(axes, x, row["error"].split(":")[0].upper())
            continue
        bottom = 0.0
        for key, label, colour in STEP_PARTS:
            axes.bar(x, row[key], bottom=bottom, color=colour, label=label)
            bottom += row[key]
        axes.annotate(f"{row['step_s']:.3f} s", (x, bottom), xytext=(0, 3), textcoords="offset points", ha="center")
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # one entry per part, not per bar
    if unique:
        figure.legend(unique.values(), unique.keys(), loc="outside right upper", fontsize=8)
    axes.set_xticks(range(len(names)), [name.replace("_", "\n", 1) for name in names], fontsize=8)
    axes.set_ylabel("seconds per step (median)")
    axes.margins(y=0.15)
    axes.set_title(
        f"grpo-step: {summary['model']} model on {summary['device']}, {_today(date)}\nmedian of {summary['steps']} "
        f"steps after {summary['warmup_steps']} warm-up" + (", long-tail lengths" if summary.get("long_tail") else ""),
        fontsize=10,
    )
    return save_figure(figure, path)


def plot_long_tail(summary: dict[str, Any], path: str | Path, date: str | None = None) -> Path:
    """Two panels of `rollout-bench long-tail`. Left: every token the model computed, split into the prompts' first
    admission, the decodes a run without preemption needs, and the tokens recomputed after preemption (their ratio
    to generated tokens, goal at most 0.1). Right: the decoding batch per step, overall and while requests wait,
    against how many samples the cache holds at full length and `max_num_seqs`.

    Args:
        summary: the subcommand's summary (`long_tail.run`).
        path: the PNG to write.
        date: the date in the title (default: today).
    Returns:
        The path written.
    """
    figure, (tokens, batch) = _new_figure(2)
    prompt = summary["first_admission_prompt_tokens"]
    recomputed = max(summary["recomputed_tokens"], 0)
    decodes = max(summary["computed_tokens"] - recomputed - prompt, 0)
    total = prompt + decodes + recomputed
    scale, unit = (1e6, " (millions)") if total >= 1e6 else (1e3, " (thousands)") if total >= 1e3 else (1, "")
    left = 0
    for value, label, colour in (
        (prompt, "prompts, first admission", "#8c8c8c"),
        (decodes, "decodes", "#4c72b0"),
        (recomputed, f"recomputed ({summary['recompute_ratio']:.3f} of generated)", "#c44e52"),
    ):
        tokens.barh(0, value / scale, left=left / scale, height=0.6, color=colour, label=label)
        left += value
    tokens.set_yticks([])
    tokens.set_xlabel(f"tokens computed{unit}")
    tokens.set_ylim(-0.6, 1.4)
    tokens.legend(loc="upper center", fontsize=8, ncol=1)
    tokens.set_title(f"{summary['preemptions']} preemptions ({summary['preemptions_swapped']} swapped)", fontsize=9)
    bars = (
        ("decoding\nper step", summary["mean_decoding_per_step"], "#4c72b0"),
        ("decoding while\nrequests wait", summary["mean_decoding_while_queued"], "#55a868"),
        ("cache holds\n(full length)", summary["cache_holds_samples"], "#8c8c8c"),
    )
    for x, (_, value, colour) in enumerate(bars):
        batch.bar(x, value, color=colour)
        batch.annotate(f"{value:g}", (x, value), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=9)
    limit = summary["max_num_seqs"]
    if limit <= 1.5 * max(value for _, value, _ in bars):  # a limit far above the bars would flatten them
        batch.axhline(limit, color="black", linestyle="--", linewidth=1)
        batch.annotate("max_num_seqs", (-0.4, limit), xytext=(0, -2), textcoords="offset points", va="top", fontsize=8)
    batch.set_xticks(range(len(bars)), [label for label, _, _ in bars], fontsize=8)
    batch.set_ylabel(f"sequences (max_num_seqs {limit})")
    batch.margins(y=0.15)
    finish = summary["last_over_median_finish"]
    batch.set_title(
        f"last / median finish {finish}x" if finish is not None else "unfinished: time budget reached", fontsize=9
    )
    figure.suptitle(
        f"long-tail: {summary['prompts']} prompts x n={summary['n']} ({summary['model']}), median "
        f"{summary['median_tokens']} tokens, cap {summary['max_tokens']}, {_today(date)}\nKV cache "
        f"{summary['cache_fraction']} of peak demand ({summary['num_blocks']} blocks of {summary['block_size']} "
        f"tokens), {summary['generated_tokens']:,} tokens generated in {summary['wall_s']} s",
        fontsize=9,
    )
    return save_figure(figure, path)


PLOTTERS: dict[str, Callable[[dict[str, Any], str | Path], Path]] = {
    "throughput": plot_throughput,
    "grpo-step": plot_grpo_step,
    "long-tail": plot_long_tail,
}
