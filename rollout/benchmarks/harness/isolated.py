"""Each benchmark system in a process of its own: nothing one system allocates, compiles or leaves behind (a KV cache,
CUDA graphs, a warm allocator, a crashed thread) reaches the next, each has its own time limit, and each system's
result is printed as one JSON line, flushed, as soon as it finishes, so a run stopped later keeps what it measured:
on stderr, with the progress (stdout holds the benchmark's summary alone, where each result is again; it was printed
on stdout too, every result twice there).

Parent side: `run_system(benchmark, system, options, timeout_s)`. Child side (`python -m
rollout.benchmarks.harness.isolated BENCHMARK SYSTEM OPTIONS_JSON`): calls the benchmark's measure function, registered
in `MEASURES`, and prints its result as the last line of its output.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, TextIO

from rollout.benchmarks.harness.section_run import Section, run_section

# Benchmark -> "module:function" measuring one system in this process: function(system, **options) -> dict. Named by
# string so that this module imports none of the benchmarks (they import it).
MEASURES = {
    "throughput": "rollout.benchmarks.throughput.systems:measure_system",
    "details": "rollout.benchmarks.throughput.details:measure_details",
    "grpo": "rollout.benchmarks.grpo.grpo:measure_system",
    "grpo-step": "rollout.benchmarks.grpo.step_system:measure_system",
}

ERROR_CHARS = 2000  # the end of a failed system's output kept in its result


def run_system(
    benchmark: str,
    system: str,
    options: dict[str, Any],
    timeout_s: float,
    stream: TextIO | None = None,
    log_dir: Path | None = None,
) -> dict[str, Any]:
    """Measure one system in a fresh process; print its result as one JSON line, flushed, on stderr (the child's own
    result line is not echoed: the result is printed once).

    Args:
        benchmark: a key of `MEASURES` (or "module:function", see `measure_here`).
        system: the system's name, passed to the measure function.
        options: the measure function's keyword arguments (JSON-able).
        timeout_s: the most seconds the process may take, warm-up included; past it, it is killed with everything
            it started.
        stream: where the child's output goes as it comes, each line prefixed with the system (default: stderr).
        log_dir: where the child's whole output is kept as <benchmark>-<system>.log (default: a temporary folder).
    Returns:
        {"system": system, "status": "ok", **the measure function's result}, or {"system", "status": "failed" |
        "timeout" | "interrupted", "seconds", "error": the end of its output} when it did not finish; either with
        "measured": `benchmark`.
    """
    argv = (sys.executable, "-m", "rollout.benchmarks.harness.isolated", benchmark, system, json.dumps(options))
    section = Section(re.sub(r"[^A-Za-z0-9._-]", "_", f"{benchmark}-{system}"), system, argv, timeout_s)
    with tempfile.TemporaryDirectory() as scratch:
        folder = log_dir or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        result = run_section(section, folder, _ProgressOnly(stream or sys.stderr))
    if result.data.get("system") == system and (result.ok or result.status == "timeout"):
        # A system killed at its limit after its result line was printed (it hung on its way out) measured all the
        # same: its figures stand (a baseline cut short says so in its own `cut_short`).
        line = {**result.data, "status": "ok"}
    else:
        error = result.error or "it printed no result"
        line = {"system": system, "status": result.status if not result.ok else "failed"}
        line.update(seconds=round(result.seconds, 1), error=error[-ERROR_CHARS:])
    line["measured"] = benchmark  # a section killed later keeps this line by it (sections.py)
    print(json.dumps(line), file=sys.stderr, flush=True)
    return line


class _ProgressOnly:
    """The console stream of a system's output (`section_run._tee` writes "  NAME | LINE") without the child's
    result line, which `run_system` prints itself, with its status."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        """Write `text` unless it is the child's result line."""
        if text.partition(" | ")[2].startswith('{"system": '):
            return 0
        return self.stream.write(text)


def measure_here(benchmark: str, system: str, options: dict[str, Any]) -> dict[str, Any]:
    """Run the benchmark's measure function for `system` in this process.

    Args:
        benchmark: a key of `MEASURES`, or a "module:function" of the same kind.
        system: passed to the function first.
        options: its keyword arguments.
    Raises:
        KeyError: an unknown benchmark.
    """
    target = MEASURES.get(benchmark) or (benchmark if ":" in benchmark else None)
    if target is None:
        raise KeyError(f"unknown benchmark {benchmark!r}; one of {sorted(MEASURES)}, or module:function")
    module, function = target.split(":")
    result = getattr(importlib.import_module(module), function)(system, **options)
    return {"system": system, **result}


def main(argv: list[str] | None = None) -> None:
    """The child's entry point: BENCHMARK SYSTEM OPTIONS_JSON; the result is the last line printed."""
    benchmark, system, options = argv or sys.argv[1:]
    print(json.dumps(measure_here(benchmark, system, json.loads(options))), flush=True)


if __name__ == "__main__":
    main()
