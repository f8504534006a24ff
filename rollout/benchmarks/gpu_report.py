"""`rollout-bench gpu-report`: every GPU figure and the GPU tests in one run, written as one markdown table and one
JSON file.

Sections, each in its own subprocess (a crash or a hang in one is reported and the next still runs), in order:

  gpu-tests     pytest -m gpu tests/gpu (bf16 parity on the Triton kernels, graph replay, sync-free steps, ...)
  kernel-tests  tests/test_triton_attention.py and tests/test_cuda_graphs.py, compiled and captured for real
  throughput    rollout-bench throughput --workload nano --details: rollout, rollout_sequential and transformers'
                generate_batch tokens/s, decode roofline fraction, peak memory, bf16 logprob fidelity
  grpo          rollout-bench grpo --device cuda: 32 prompts x n=8 vs transformers' generate_batch
  weights       rollout-bench weights: a Qwen3-0.6B-sized bf16 state dict (1.2 GB) into a GPU worker over
                ZeroMQ frames and shared memory: GB/s, commit pause, pause beyond the copy

Writes DIR/gpu_report.md, DIR/gpu_report.json and each section's output as DIR/<section>.log. Exits 1 when any
test failed or any section did not finish, 2 without a CUDA GPU (before running anything).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from rollout.benchmarks.report import SectionResult, goals, render_markdown

TAIL_LINES = 40  # lines of a failed section's output kept in the report


@dataclass(frozen=True)
class Section:
    """One part of the report: a command run in its own process."""

    name: str
    title: str
    argv: tuple[str, ...]
    timeout_s: float
    tests: bool = False  # a pytest run: counts come from its JUnit XML; otherwise its last output line is JSON


def sections(tests_dir: Path, python: str = sys.executable) -> list[Section]:
    """The report's sections, in the order they run. Timeouts are ceilings well above what each should take on an
    H100, so a hang is reported rather than waited out; `--only` splits a run across several shorter calls."""
    bench = (python, "-m", "rollout.benchmarks.cli")
    pytest = (python, "-m", "pytest", "-q", "-p", "no:cacheprovider")
    return [
        Section("gpu-tests", "GPU tests (tests/gpu)", (*pytest, "-m", "gpu", str(tests_dir / "gpu")), 150, tests=True),
        Section(
            "kernel-tests",
            "Triton kernels and CUDA graphs, compiled",
            (*pytest, str(tests_dir / "test_triton_attention.py"), str(tests_dir / "test_cuda_graphs.py")),
            120,
            tests=True,
        ),
        Section(
            "throughput",
            "nano workload",
            (*bench, "throughput", "--workload", "nano", "--details", "--repeats", "1"),
            420,
        ),
        Section("grpo", "GRPO workload", (*bench, "grpo", "--device", "cuda"), 240),
        Section(
            "weights",
            "weights into a GPU worker",
            (*bench, "weights", "--device", "cuda", "--dtype", "bfloat16", "--size-mb", "1200")
            + ("--transports", "frames", "shm", "--repeats", "3"),
            240,
        ),
    ]


SECTION_NAMES = tuple(section.name for section in sections(Path("tests")))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `rollout-bench gpu-report`."""
    parser.add_argument(
        "--out", type=Path, default=Path("gpu-report"), metavar="DIR", help="output folder (default: gpu-report)"
    )
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--only", nargs="+", choices=SECTION_NAMES, metavar="SECTION", help="run only these sections")
    chosen.add_argument("--skip", nargs="+", choices=SECTION_NAMES, metavar="SECTION", help="skip these sections")
    parser.add_argument(
        "--tests-dir",
        type=Path,
        default=Path("tests"),
        help="the checkout's tests folder, for the test sections (default: tests, relative to the current folder)",
    )


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the chosen sections and write the report; the exit status (0 ok, 1 something failed, 2 no GPU)."""
    chosen = [
        s
        for s in sections(args.tests_dir)
        if (args.only is None or s.name in args.only) and s.name not in (args.skip or ())
    ]
    if not chosen:
        parser.error("gpu-report: --skip leaves no section to run")
    if any(s.tests for s in chosen) and not (args.tests_dir / "gpu").is_dir():
        parser.error(
            f"gpu-report: --tests-dir {args.tests_dir} has no gpu/ folder; run from a rollout checkout, pass "
            "--tests-dir, or leave the test sections out with --skip gpu-tests kernel-tests"
        )
    import torch

    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            f"rollout-bench gpu-report needs a CUDA GPU, and torch {torch.__version__} ({built}) sees none; "
            "nothing was run.",
            file=sys.stderr,
        )
        return 2
    return run_report(chosen, args.out, environment())


def run_report(chosen: list[Section], out: Path, machine: dict[str, Any], stream: TextIO = sys.stdout) -> int:
    """Run `chosen` one after another, write gpu_report.md and gpu_report.json into `out`, print the table.

    Args:
        chosen: the sections to run, in order.
        out: the output folder (created).
        machine: the environment() figures the report's header names.
        stream: where the sections' output and progress lines go.

    Returns:
        0 when every section finished and no test failed, else 1.
    """
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for index, section in enumerate(chosen, 1):
        print(f"gpu-report [{index}/{len(chosen)}] {section.name}: {' '.join(section.argv)}", file=stream, flush=True)
        result = run_section(section, out, stream)
        results.append(result)
        print(
            f"gpu-report [{index}/{len(chosen)}] {section.name}: {result.status} in {result.seconds:.0f} s", file=stream
        )
    markdown = render_markdown(machine, results)
    ok = all(result.ok for result in results)
    report = {"report": "gpu-report", "ok": ok, "environment": machine, "goals": goals(results)}
    report["sections"] = {result.name: asdict(result) for result in results}
    (out / "gpu_report.md").write_text(markdown)
    (out / "gpu_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(markdown, file=stream)
    print(
        f"gpu-report: {'all sections ok' if ok else 'FAILED'}; wrote {out / 'gpu_report.md'} and gpu_report.json",
        file=stream,
    )
    return 0 if ok else 1


def run_section(section: Section, out: Path, stream: TextIO) -> SectionResult:
    """Run one section in its own process group, its output teed to `stream` and to out/<name>.log; a section past
    its timeout is killed with everything it started."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # kernels compiled for real
    env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryDirectory() as scratch:
        junit = Path(scratch) / "junit.xml"
        argv = [*section.argv, f"--junitxml={junit}"] if section.tests else list(section.argv)
        lines: list[str] = []
        start = time.monotonic()
        with open(out / f"{section.name}.log", "w") as log:
            process = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
            )

            def tee() -> None:
                for line in process.stdout:
                    lines.append(line)
                    log.write(line)
                    stream.write(f"  {section.name} | {line}")

            reader = threading.Thread(target=tee, daemon=True)
            reader.start()
            try:
                returncode = process.wait(section.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the section and every process it started
                returncode, timed_out = process.wait(), True
            reader.join(10)
            process.stdout.close()
        seconds = time.monotonic() - start
        tail = "".join(lines[-TAIL_LINES:])
        if timed_out:
            return SectionResult(
                section.name, section.title, "timeout", seconds, error=f"killed after {section.timeout_s:.0f} s\n{tail}"
            )
        if section.tests:
            return _tests_result(section, seconds, returncode, junit, tail)
        return _bench_result(section, seconds, returncode, lines, tail)


def _bench_result(section: Section, seconds: float, returncode: int, lines: list[str], tail: str) -> SectionResult:
    last = next((line for line in reversed(lines) if line.strip()), "")
    try:
        data = json.loads(last)
    except json.JSONDecodeError:
        data = None
    if returncode != 0 or not isinstance(data, dict):
        why = f"exit status {returncode}" if returncode != 0 else "its last output line is not a JSON summary"
        return SectionResult(section.name, section.title, "failed", seconds, error=f"{why}\n{tail}")
    return SectionResult(section.name, section.title, "ok", seconds, data=data)


def _tests_result(section: Section, seconds: float, returncode: int, junit: Path, tail: str) -> SectionResult:
    counts = junit_counts(junit) if junit.exists() else {}
    failing = counts.pop("failing", [])
    problems = [f"failed: {name}" for name in failing]
    if not counts:
        problems.append(f"pytest wrote no results (exit status {returncode})")
    elif counts["passed"] == 0:
        problems.append(f"no test passed ({counts['skipped']} skipped)")
    elif returncode != 0 and not failing:
        problems.append(f"pytest exit status {returncode}")
    status = "failed" if problems else "ok"
    error = "\n".join(problems) + f"\n{tail}" if problems else None
    return SectionResult(section.name, section.title, status, seconds, data=counts, error=error)


def junit_counts(path: Path) -> dict[str, Any]:
    """passed / failed / errors / skipped counts and the failing tests' ids from a pytest JUnit XML file."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failing = []
    for case in root.iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            message = (problem.get("message") or "").strip().splitlines()
            failing.append(f"{case.get('classname')}::{case.get('name')}" + (f": {message[0]}" if message else ""))
    return {
        "tests": counts["tests"],
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "failing": failing,
    }


def environment() -> dict[str, Any]:
    """The GPU, its driver, the library versions, the date and the checkout's commit."""
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    properties = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "gpu": properties.name,
        "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
        "driver": _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": _command_output(["git", "rev-parse", "--short", "HEAD"]),
    }


def _command_output(argv: list[str]) -> str | None:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else None
