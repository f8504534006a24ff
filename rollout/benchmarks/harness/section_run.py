"""One section of `rollout-bench gpu-report`: a command run in its own process group, its output teed to the console
and to a log, its result read from a JSON summary (benchmarks) or from its tests' outcomes, written as each test
finishes (`pytest_outcomes.py`: a test section killed at its limit keeps the counts of the tests it finished).

Whatever the section does (crash, hang, leave processes behind, print undecodable bytes, be interrupted), the
report gets a `SectionResult` and nothing the section started outlives it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rollout.benchmarks.harness import pytest_outcomes
from rollout.process_groups import die_with_parent, kill_group

TAIL_LINES = 40  # lines of a failed section's output kept in the report
SEARCHED_LINES = 200  # last lines searched for the JSON summary (warnings may follow it)
READER_GRACE_S = 30.0  # how long the output is still read after the section's processes were killed
SUMMARY_MARGIN_S = 20.0  # of a section's timeout, left to a budgeted command to print its summary


@dataclass
class SectionResult:
    """What one section of the report produced."""

    name: str
    title: str
    status: str  # "ok", "failed", "timeout", "interrupted" or "skipped" (too little of the budget left to start it)
    seconds: float
    data: dict[str, Any] = field(default_factory=dict)  # a benchmark's JSON summary, or a test section's counts
    error: str | None = None  # why it failed: exit status, failing tests, the end of its output
    # The machine it ran on (environment()): set on every section, so a report merged from several calls (several
    # fresh machines) says which machine each figure comes from.
    machine: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        """Whether the section ran to the end and nothing in it failed."""
        return self.status == "ok"


@dataclass(frozen=True)
class Section:
    """One part of the report: a command run in its own process."""

    name: str
    title: str
    argv: tuple[str, ...]
    timeout_s: float
    # A pytest run: counts come from its tests' outcomes as each finished (<name>.outcomes.jsonl in the output
    # folder, `pytest_outcomes.py`); otherwise from a JSON summary line.
    tests: bool = False
    benchmark: str | None = None  # the "benchmark" its JSON summary must name (None: any)
    # A flag that tells the command how many seconds it has (its timeout less a margin to print its summary), so it
    # can share them out itself (e.g. throughput's --time-budget); None: the command is not told.
    budget_flag: str | None = None
    # The least time worth starting it with: under a budget, the sections before it leave it this much, and it is
    # skipped (said so) when less is left.
    reserve_s: float = 0.0
    # Why every test of a `tests` section may skip here (a CPU rehearsal of GPU tests): a run whose tests all skipped
    # is then reported "skipped", with this reason, not failed. None: all skipped is a failure.
    skips_expected: str | None = None

    def within(self, seconds: float) -> Section:
        """This section with at most `seconds` to run (its own timeout when that is shorter)."""
        timeout = min(self.timeout_s, seconds)
        argv = self.argv
        if self.budget_flag is not None:
            argv = (*argv, self.budget_flag, f"{max(1.0, timeout - SUMMARY_MARGIN_S):.0f}")
        return dataclasses.replace(self, timeout_s=timeout, argv=argv)


class SectionInterrupted(KeyboardInterrupt):
    """This process was interrupted while a section ran: the section was killed; `result` is what it had printed."""

    def __init__(self, result: SectionResult) -> None:
        super().__init__(f"interrupted during {result.name}")
        self.result = result


def run_section(section: Section, out: Path, stream: TextIO) -> SectionResult:
    """Run one section in its own process group; its output goes to out/<name>.log and, best effort, to `stream`;
    a test section's outcomes, as each test finishes, to out/<name>.outcomes.jsonl.

    Past its timeout, or when this process is interrupted, the section is killed with everything it started; after
    it exits, whatever it left running is killed too. A section killed keeps what it had printed: its summary, or
    else its finished systems' lines.

    Raises:
        SectionInterrupted: this process got SIGINT or SIGTERM (as KeyboardInterrupt) while the section ran.
    """
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # kernels compiled for real
    env["PYTHONUNBUFFERED"] = "1"
    outcomes = out / f"{section.name}.outcomes.jsonl"
    outcomes.unlink(missing_ok=True)  # an earlier run's into the same folder: never read as this one's
    argv = list(section.argv)
    if section.tests:  # each test's outcome written as it finishes: what a kill at the limit leaves is counted
        argv += ["-p", pytest_outcomes.PLUGIN, f"{pytest_outcomes.OPTION}={outcomes.absolute()}"]
    lines: deque[str] = deque(maxlen=SEARCHED_LINES)
    systems: dict[str, dict[str, Any]] = {}  # each system's own result line (isolated.run_system), as it came
    start = time.monotonic()
    with open(out / f"{section.name}.log", "w", encoding="utf-8") as log:
        try:
            process = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                encoding="utf-8",
                errors="replace",  # one undecodable byte must not stop the draining of the pipe
                env=env,
                start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
            )
        except OSError as error:
            return SectionResult(section.name, section.title, "failed", 0.0, error=f"cannot start: {error}")
        reader = threading.Thread(target=_tee, args=(process, section.name, log, stream, lines, systems), daemon=True)
        reader.start()
        timed_out = False
        interrupted = False
        try:
            returncode = process.wait(section.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except KeyboardInterrupt:  # SIGINT or SIGTERM (process_groups.interrupt_on_signals): report, then raise
            interrupted = True
        finally:  # also on SystemExit: nothing the section started outlives it
            kill_group(process)
            if timed_out or interrupted:
                returncode = process.wait()
        reader.join(READER_GRACE_S)  # the pipe closes once every process of the group is gone
    seconds = time.monotonic() - start
    tail = "".join(list(lines)[-TAIL_LINES:])
    if reader.is_alive():  # a process outside the group (it called setsid) still holds the pipe: stop reading
        tail += "\n[gpu-report: the section's output stayed open after it ended; stopped reading it]\n"
    if timed_out or interrupted:  # what it had printed is kept: its summary, else its finished systems or tests
        status, why = ("timeout", f"killed after {section.timeout_s:.0f} s") if timed_out else ("interrupted", "")
        if section.tests:
            by = "at the time limit" if timed_out else "by the interrupt"
            data, problems = pytest_outcomes.section_outcome(outcomes, None, cut_by=by)
            why = "\n".join([why or status, *problems])
        else:
            data = _summary(section, list(lines)) or _finished(section, systems)
        result = SectionResult(section.name, section.title, status, seconds, data, f"{why or status}\n{tail}")
        if interrupted:
            raise SectionInterrupted(result)
        return result
    if section.tests:
        return _tests_result(section, seconds, returncode, outcomes, tail)
    return _bench_result(section, seconds, returncode, list(lines), tail, systems)


def _tee(
    process: subprocess.Popen,
    name: str,
    log: TextIO,
    stream: TextIO,
    lines: deque[str],
    systems: dict[str, dict[str, Any]],
) -> None:
    """Drain the section's output to the log and the console until the pipe closes, whatever the console does;
    keep each system's result line (`{"system": ..., "status": ...}`) in `systems`."""
    for line in process.stdout:
        lines.append(line)
        if line.startswith('{"system": '):
            found = _json_object(line)
            if found is not None and isinstance(found.get("system"), str) and "status" in found:
                systems[f"{found.get('measured')}:{found['system']}"] = found
        for target, text in ((log, line), (stream, f"  {name} | {line}")):
            try:
                target.write(text)
            except (OSError, ValueError):  # a closed console (e.g. `| head`), or a log closed after the grace
                pass
    process.stdout.close()


def _summary(section: Section, lines: list[str]) -> dict[str, Any] | None:
    """The benchmark summary a section printed before it was killed (it hung on its way out), if any."""
    data = None if section.tests else _last_json(lines)
    return data if data is not None and data.get("benchmark") == section.benchmark else None


def _finished(section: Section, systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What a section that did not finish had measured, as a partial summary: its systems' result lines (and
    throughput's `details`), keyed by `{measured}:{system}` in `systems`."""
    if section.tests or not systems:
        return {}
    found: dict[str, Any] = {"benchmark": section.benchmark, "partial": True, "results": {}}
    for key, line in systems.items():
        measured, system = key.split(":", 1)
        if measured == "details":
            found["details"] = line
        elif measured == section.benchmark:
            found["results"][system] = line
    return found


def _bench_result(
    section: Section,
    seconds: float,
    returncode: int,
    lines: list[str],
    tail: str,
    systems: dict[str, dict[str, Any]] | None = None,
) -> SectionResult:
    data = _last_json(lines)
    problem = None
    if returncode != 0:
        problem = f"exit status {returncode}"
    elif data is None:
        problem = "it printed no JSON summary"
    elif section.benchmark is not None and data.get("benchmark") != section.benchmark:
        problem = f"its JSON summary is not a {section.benchmark!r} benchmark's"
    elif section.benchmark is not None and unfinished_parts(data):
        # The benchmark exits 0 and prints its summary when a system in it timed out or failed: the section did not
        # measure what it is for (its figures read "not measured"), and the report must say why.
        problem = "not every system finished: " + "; ".join(unfinished_parts(data))
    if problem:
        data = data if data and data.get("benchmark") else _finished(section, systems or {})
        return SectionResult(section.name, section.title, "failed", seconds, data=data, error=f"{problem}\n{tail}")
    return SectionResult(section.name, section.title, "ok", seconds, data=data)


def unfinished_parts(data: dict[str, Any]) -> list[str]:
    """The systems of a benchmark summary that did not finish, as "name: status (first line of its error)": a
    system's line (`isolated.run_system`) in `results`, at the top level (grpo's) or throughput's `details`, whose
    status is not "ok"; a `results` row that is only an error (grpo-step's); an interrupted summary. A baseline cut
    short at its own deadline finished (its status is "ok"); values of other shapes are not systems.

    Args:
        data: the JSON summary a section printed.
    """
    results = data.get("results") if isinstance(data.get("results"), dict) else {}
    candidates = list(results.items()) + [
        (name, line)
        for name, line in data.items()
        if name == "details" or (isinstance(line, dict) and "system" in line)
    ]
    found = ["the run was interrupted"] if data.get("interrupted") is True else []
    for name, line in candidates:
        if not isinstance(line, dict) or ("status" not in line and "error" not in line):
            continue
        status = line.get("status", "failed")
        if status != "ok":
            first = str(line.get("error") or "").strip().splitlines()
            found.append(f"{name}: {status}" + (f" ({first[0][:200]})" if first else ""))
    return found


def _last_json(lines: list[str]) -> dict[str, Any] | None:
    """The last line that is a JSON object (exit-time warnings may follow it)."""
    for line in reversed(lines):
        data = _json_object(line)
        if data is not None:
            return data
    return None


def _json_object(line: str) -> dict[str, Any] | None:
    """The line as a JSON object, or None when it is not one."""
    if not line.lstrip().startswith("{"):
        return None
    try:
        data = json.loads(line)
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def _tests_result(section: Section, seconds: float, returncode: int, outcomes: Path, tail: str) -> SectionResult:
    data, problems = pytest_outcomes.section_outcome(outcomes, returncode)
    all_skipped = bool(data.get("tests")) and data.get("skipped") == data.get("tests") and not returncode
    if problems and section.skips_expected is not None and all_skipped:
        return SectionResult(
            section.name, section.title, "skipped", seconds, data=data, error=f"not run: {section.skips_expected}"
        )
    error = "\n".join(problems) + f"\n{tail}" if problems else None
    return SectionResult(section.name, section.title, "failed" if problems else "ok", seconds, data=data, error=error)
