"""`rollout-bench gpu-report`: every GPU figure and the GPU tests in one run, written as one markdown table and one
JSON file.

Sections, each in its own process group (a crash or a hang in one is reported and the next still runs), in order,
the headline first:

  throughput               rollout on the nano workload (warmed up, a 40 GiB KV budget), with --details: decode
                           roofline fraction, peak memory, bf16 logprob fidelity against the trainer's own floor, host
                           time per step
  baseline-generate-batch  transformers' generate_batch on the same workload, stopping at its own time limit
  baseline-generate        transformers' generate (one static batch), with what is left (stopping likewise)
  grpo-step-nano           colocated GRPO steps on the Qwen3-0.6B architecture, peak memory, what sleep() frees;
                           then the same steps with batch_invariant=True (their price, goal 1.25x)
  weights                  a Qwen3-0.6B-sized bf16 state dict (1.2 GB) into a GPU worker over ZeroMQ frames and
                           shared memory: GB/s, commit pause, pause beyond the copy
  gpu-tests                pytest -m gpu tests/gpu (graph capture and replay, sync-free steps, ...)
  speculative              the long tail without and with speculative decoding, the Qwen3-0.6B architecture at low
                           entropy on the GPU: forwards and milliseconds per token in the tail, its plain and
                           drafted steps' periods, tokens/s, the round's last sample (goal 1.5x sooner)
  kernel-tests             tests/test_triton_attention.py, test_cuda_graphs.py and test_verify_graphs.py, compiled
                           and captured
  grpo, grpo-step, overlap, structured
                           GRPO groups; the main job's steps against TRL's paths; overlapped scheduling off;
                           structured outputs on the GPU

Writes DIR/gpu_report.md, DIR/gpu_report.json (after every section; a section cut short or interrupted keeps what
it had printed, a test section the tests it finished) and each section's output as DIR/<section>.log; a test
section's outcomes, one JSON line as each test finishes, as DIR/<section>.outcomes.jsonl. Under `--budget-s`, each section gets what is left
less the least time of the sections after it (`reserve_s`), and is skipped, said so, when too little is left.
`--plan` prints the device calls of a 15-minute GPU window (`plan.py`); `--workload cpu-small` rehearses the same
sections on a CPU; `--merge` joins earlier calls' reports. Exits 1 when any test failed or any section did not
finish, 2 without a CUDA GPU (before running anything).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from rollout.benchmarks.gpu_report.sections import SECTION_NAMES, sections
from rollout.benchmarks.gpu_report.table import goals, render_markdown
from rollout.benchmarks.harness.section_run import Section, SectionResult, run_section
from rollout.process_groups import process_age_s

# Of a section's share under a budget, left for its end: the kill of its process group at its limit, the wait for
# it and the drain of its output (about a second; more on a loaded machine).
END_MARGIN_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `rollout-bench gpu-report`."""
    parser.add_argument(
        "--out", type=Path, default=Path("gpu-report"), metavar="DIR", help="output folder (default: gpu-report)"
    )
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument(
        "--only", nargs="+", choices=SECTION_NAMES, metavar="SECTION", help="run only these sections (default: all)"
    )
    chosen.add_argument(
        "--skip", nargs="+", choices=SECTION_NAMES, metavar="SECTION", help="skip these sections (default: none)"
    )
    parser.add_argument(
        "--tests-dir",
        type=Path,
        default=Path("tests"),
        help="the checkout's tests folder, for the test sections (default: tests, relative to the current folder)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the most this whole run may take: each section gets at most what is left (a section cut short is "
        "reported as a timeout, and the report is still written); default: each section's own ceiling",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=[],
        metavar="JSON",
        help="gpu_report.json files of earlier calls (e.g. on other, fresh machines) whose sections join this report "
        "unless run again (default: none)",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the device calls that produce the report inside a 15-minute GPU window (the headline in one call "
        "of at most 430 s, then an optional follow-up), the wheels to fetch first and the CPU rehearsal, and exit",
    )
    parser.add_argument("--json", action="store_true", help="with --plan: print the plan as one JSON object")
    parser.add_argument(
        "--commit",
        default=None,
        help="the checkout's commit, named in the report (default: read from git; a copy without git history, as "
        "on a lent GPU machine, has none, so --plan's commands name it)",
    )
    parser.add_argument(
        "--workload",
        choices=("nano", "cpu-small"),
        default="nano",
        help="nano (default): the GPU report; cpu-small: rehearse the same sections on a CPU, no GPU needed (the "
        "plan's rehearsal runs each call's command so)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start a new report; by default sections run earlier into the same --out (e.g. split with --only) "
        "stay in the report unless run again",
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the chosen sections and write the report; the exit status (0 ok, 1 something failed, 2 no GPU, 130
    interrupted). With `--plan`, print the device calls instead (no GPU needed)."""
    if args.plan:
        ignored = [
            flag
            for flag, given in (
                ("--only", args.only),
                ("--skip", args.skip),
                ("--merge", args.merge),
                ("--budget-s", args.budget_s is not None),
                ("--fresh", args.fresh),
                ("--commit", args.commit),
                ("--workload", args.workload != "nano"),
                ("--out", args.out != Path("gpu-report")),
                ("--tests-dir", args.tests_dir != Path("tests")),
            )
            if given
        ]
        if ignored:
            parser.error(f"gpu-report: --plan prints the calls' own commands; leave out {', '.join(ignored)}")
        from rollout.benchmarks.gpu_report.plan import render_plan

        print(render_plan(as_json=args.json))
        return 0
    if args.json:
        parser.error("gpu-report: --json goes with --plan (the report itself is always written as gpu_report.json)")
    if args.budget_s is not None and not (math.isfinite(args.budget_s) and args.budget_s > 0):
        parser.error(f"gpu-report: --budget-s must be a number > 0, got {args.budget_s}")
    earlier: dict[str, SectionResult] = {}
    for path in args.merge:
        found = _earlier_results(path)
        if not found:
            parser.error(f"gpu-report: --merge {path}: not an earlier call's gpu_report.json (missing or unreadable)")
        earlier.update(found)
    chosen = [
        s
        for s in sections(args.tests_dir, workload=args.workload)
        if (args.only is None or s.name in args.only) and s.name not in (args.skip or ())
    ]
    if not chosen:
        parser.error("gpu-report: --skip leaves no section to run")
    if any(s.tests for s in chosen) and not (args.tests_dir / "gpu").is_dir():
        parser.error(
            f"gpu-report: --tests-dir {args.tests_dir} has no gpu/ folder; run from a rollout checkout, pass "
            "--tests-dir, or leave the test sections out with --skip gpu-tests kernel-tests"
        )
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"gpu-report: --out {args.out} exists and is not a folder")
    import torch

    rehearsal = args.workload != "nano"
    if not rehearsal and not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            f"rollout-bench gpu-report needs a CUDA GPU, and torch {torch.__version__} ({built}) sees none; "
            "nothing was run.",
            file=sys.stderr,
        )
        return 2
    # A terminated or interrupted report still kills its section's process group and writes the report: the
    # rollout-bench entry point turns SIGINT and SIGTERM into KeyboardInterrupt (process_groups.interrupt_on_signals).
    # The budget counts from this process's start: its imports took some of it.
    budget_s = None if args.budget_s is None else max(1.0, args.budget_s - process_age_s())
    return run_report(
        chosen,
        args.out,
        environment(rehearsal, args.commit),
        keep_earlier=not args.fresh,
        budget_s=budget_s,
        merged=earlier,
    )


def run_report(
    chosen: list[Section],
    out: Path,
    machine: dict[str, Any],
    stream: TextIO = sys.stdout,
    keep_earlier: bool = True,
    budget_s: float | None = None,
    merged: dict[str, SectionResult] | None = None,
) -> int:
    """Run `chosen` one after another; after each, write gpu_report.md and gpu_report.json into `out` (a call cut
    short keeps what finished) and print the table at the end.

    Args:
        chosen: the sections to run, in order.
        out: the output folder (created).
        machine: the environment() figures the report's header names.
        stream: where the sections' output and progress lines go.
        keep_earlier: keep the results of sections an earlier report in `out` ran and this one does not.
        budget_s: the most seconds the whole run may take; each section gets at most what is left.
        merged: sections of earlier calls' reports (`--merge`), kept unless run again (after those in `out`).

    Returns:
        0 when every section of the report finished and no test failed, 130 when interrupted, else 1.
    """
    out.mkdir(parents=True, exist_ok=True)
    earlier = {**(merged or {}), **(_earlier_results(out / "gpu_report.json") if keep_earlier else {})}
    results: dict[str, SectionResult] = {}
    interrupted = False
    deadline = None if budget_s is None else time.monotonic() + budget_s
    for index, section in enumerate(chosen, 1):
        left = section.timeout_s if deadline is None else deadline - time.monotonic()
        # The sections after it keep their least time; in order, though: the headline first, so a section that
        # cannot have all it would like still starts with its own least time while that much is left.
        kept = 0.0 if deadline is None else sum(later.reserve_s for later in chosen[index:])
        least = max(1.0, section.reserve_s)
        if left < least:  # not worth starting
            why = f"{max(0.0, left):.0f} s of the budget left, less than the {least:.0f} s it needs to start"
            result = SectionResult(section.name, section.title, "skipped", 0.0, error=f"not run: {why}")
        else:
            # Less a margin for its end (killed at its limit, its output drained) where sections follow: one that
            # runs to its limit must still leave them their least time, or the next is skipped a second short.
            margin = END_MARGIN_S if index < len(chosen) else 0.0
            section = section.within(max(least, left - kept - margin))
            _say(stream, f"gpu-report [{index}/{len(chosen)}] {section.name}: {' '.join(section.argv)}")
            try:
                result = run_section(section, out, stream)
            except KeyboardInterrupt as stop:  # the section was killed; what it had printed is kept
                result = getattr(stop, "result", None) or SectionResult(
                    section.name, section.title, "interrupted", 0.0, error="interrupted"
                )
                interrupted = True
        result.machine = machine
        results[section.name] = result
        _say(stream, f"gpu-report [{index}/{len(chosen)}] {section.name}: {result.status} in {result.seconds:.0f} s")
        markdown, ok = _write(out, machine, results, earlier, interrupted)
        if interrupted:
            break
    reused = [name for name in SECTION_NAMES if name in earlier and name not in results]
    _say(stream, markdown)
    _say(
        stream,
        f"gpu-report: {'all sections ok' if ok else 'FAILED'}; wrote {out / 'gpu_report.md'} and gpu_report.json"
        + (f" (kept from earlier runs: {', '.join(reused)}; --fresh starts over)" if reused else ""),
    )
    return 130 if interrupted else 0 if ok else 1


def _write(
    out: Path,
    machine: dict[str, Any],
    results: dict[str, SectionResult],
    earlier: dict[str, SectionResult],
    interrupted: bool,
) -> tuple[str, bool]:
    """Write the report of what ran so far (and what earlier runs kept); (its markdown, whether all is ok)."""
    order = [name for name in SECTION_NAMES if name in results or name in earlier]
    report_results = [results.get(name) or earlier[name] for name in order]
    markdown = render_markdown(machine, report_results)
    ok = all(result.ok for result in report_results) and not interrupted
    report = {"report": "gpu-report", "ok": ok, "environment": machine, "goals": goals(report_results)}
    report["sections"] = {result.name: asdict(result) for result in report_results}
    (out / "gpu_report.md").write_text(markdown)
    (out / "gpu_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return markdown, ok


def _say(stream: TextIO, text: str) -> None:
    """Progress on the console, best effort: a closed console must not lose the report."""
    try:
        print(text, file=stream, flush=True)
    except (OSError, ValueError):
        pass


def _earlier_results(path: Path) -> dict[str, SectionResult]:
    """The sections of an earlier report in the same folder (none when it is missing or unreadable)."""
    try:
        report = json.loads(path.read_text())
        found = {name: SectionResult(**fields) for name, fields in report["sections"].items() if name in SECTION_NAMES}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    for result in found.values():
        if not isinstance(result.seconds, int | float) or not isinstance(result.data, dict):
            return {}  # a hand-edited or truncated report: not merged, rather than a crash once sections ran
        result.machine = result.machine or report.get("environment")
    return found


def environment(rehearsal: bool = False, commit: str | None = None) -> dict[str, Any]:
    """The GPU, its driver, the library versions, the date and the checkout's commit.

    Args:
        rehearsal: a CPU rehearsal (`--workload cpu-small`): no GPU to name.
        commit: the checkout's commit (`--commit`); None: read from git.
    """
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if rehearsal:
        gpu, memory, driver = "none (CPU rehearsal)", None, None
    else:
        properties = torch.cuda.get_device_properties(0)
        gpu, memory = properties.name, round(properties.total_memory / 2**30, 1)
        driver = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "gpu": gpu,
        "gpu_memory_gib": memory,
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": commit or _command_output(["git", "rev-parse", "--short", "HEAD"]),
    }


def _command_output(argv: list[str]) -> str | None:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else None
