"""Each test's outcome as it finishes, for a test section of `rollout-bench gpu-report` (`section_run.py`): a pytest
plugin that appends one JSON line per event to a file, and the reader that counts them.

pytest writes its JUnit XML only when the run ends, so a section killed at its time limit (or a pytest that dies in
a CUDA kernel) used to lose every count. Loaded with `-p rollout.benchmarks.harness.pytest_outcomes --outcome-log
PATH` (no conftest, no extra package), the plugin writes and flushes, in this order:

  {"event": "collected", "count": 70}
  {"event": "start", "test": "tests/test_x.py::test_a"}
  {"event": "finish", "test": "tests/test_x.py::test_a", "outcome": "passed", "seconds": 1.2, "message": null}
  ...
  {"event": "end", "exit_status": 0}

Each line is flushed to the file as it is written (the kernel keeps it when the process is killed), so the reader
gets every test that finished, the one that was running, and whether pytest got to its end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

PLUGIN = __name__  # what `-p` names
OPTION = "--outcome-log"
# A test's outcome is the worst of its phases' (setup, call, teardown), as JUnit XML counts it: a test that fails
# and then errors in teardown counts once, as failed.
ORDER = ("passed", "skipped", "errors", "failed")
COUNTS = ("tests", "passed", "failed", "errors", "skipped")  # a section's counts, in the report's order
MESSAGE_CHARS = 300  # of a failure's first line, kept


def pytest_addoption(parser: Any) -> None:
    """The plugin's one option: where the outcomes go."""
    parser.addoption(OPTION, default=None, metavar="PATH", help="append each test's outcome to PATH as a JSON line")


def pytest_configure(config: Any) -> None:
    """Write the outcomes when `--outcome-log` is given; in pytest-xdist's controller only (its workers' reports
    reach the controller's hooks too)."""
    path = config.getoption(OPTION)
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_OutcomeLog(open(path, "a", encoding="utf-8")), "rollout-outcome-log")


class _OutcomeLog:
    """The hooks that write the lines; `phases` holds a running test's outcome so far and its seconds."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.phases: dict[str, tuple[str, float, str | None]] = {}

    def _write(self, line: dict[str, Any]) -> None:
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def pytest_collection_finish(self, session: Any) -> None:
        self._write({"event": "collected", "count": len(session.items)})

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:  # a file that does not import: JUnit XML counts it as an error too
            test = report.nodeid or "collection"
            self._write(
                {"event": "finish", "test": test, "outcome": "errors", "seconds": 0.0, "message": _message(report)}
            )

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self._write({"event": "start", "test": nodeid})

    def pytest_runtest_logreport(self, report: Any) -> None:
        outcome, message = "passed", None
        if report.failed:
            outcome, message = ("failed" if report.when == "call" else "errors"), _message(report)
        elif report.skipped:  # skipped, or an expected failure (xfail): JUnit XML counts both as skipped
            outcome, message = "skipped", _skip_reason(report)
        before, seconds, before_message = self.phases.get(report.nodeid, ("passed", 0.0, None))
        if ORDER.index(before) >= ORDER.index(outcome):
            outcome, message = before, before_message
        self.phases[report.nodeid] = (outcome, seconds + report.duration, message)
        if report.when == "teardown":  # the last phase, whatever happened in the others
            outcome, seconds, message = self.phases.pop(report.nodeid)
            line = {"event": "finish", "test": report.nodeid, "outcome": outcome, "seconds": round(seconds, 3)}
            self._write({**line, "message": message})

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        self._write({"event": "end", "exit_status": int(exitstatus)})
        self.file.close()


def _message(report: Any) -> str:
    """The first line of what went wrong (the crash's message, as JUnit XML gives it)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = text.strip().splitlines()
    return lines[0][:MESSAGE_CHARS] if lines else ""


def _skip_reason(report: Any) -> str | None:
    """Why a test was skipped (pytest's (file, line, reason) triple), or None for an expected failure."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")[:MESSAGE_CHARS]
    return None


def read_outcomes(path: Path) -> dict[str, Any]:
    """What a run's outcome log says: counts of finished tests by outcome, the failing tests (`id: message`), how
    many were collected, the test that started and did not finish, and whether pytest reached its end. Lines that
    are not the plugin's (a line cut short as the process was killed) are passed over.

    Args:
        path: the `--outcome-log` file; missing: nothing ran (or the plugin never loaded).

    Returns:
        {"tests", "passed", "failed", "errors", "skipped": counts, "failing": [...], "collected": int | None,
        "running": str | None, "ended": bool}; "tests" is 0 when no test finished.
    """
    outcomes: dict[str, str] = {}
    failing: dict[str, str] = {}
    collected, running, ended = None, None, False
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        text = ""
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue
        event = line.get("event") if isinstance(line, dict) else None
        test = line.get("test") if isinstance(line, dict) else None
        if event == "collected" and isinstance(line.get("count"), int):
            collected = line["count"]
        elif event == "start" and isinstance(test, str):
            running = test
        elif event == "finish" and isinstance(test, str) and line.get("outcome") in ORDER:
            if ORDER.index(line["outcome"]) >= ORDER.index(outcomes.get(test, "passed")):
                outcomes[test] = line["outcome"]
            if line["outcome"] in ("failed", "errors"):
                failing[test] = test + (f": {line['message']}" if line.get("message") else "")
            running = None if running == test else running
        elif event == "end":
            ended = True
    counts = {key: sum(outcome == key for outcome in outcomes.values()) for key in ORDER}
    found = {"tests": len(outcomes), "passed": counts["passed"], "failed": counts["failed"]}
    found |= {"errors": counts["errors"], "skipped": counts["skipped"], "failing": list(failing.values())}
    return {**found, "collected": collected, "running": running, "ended": ended}


def section_outcome(path: Path, returncode: int | None, cut_by: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """A test section's data (its counts, failing tests, how many were collected and, when it stopped before its
    end, where: "cut") and its problems (none: ok), from its outcome log.

    Args:
        path: the `--outcome-log` file.
        returncode: pytest's exit status when it ended by itself; None when it was killed.
        cut_by: why it was killed ("at the time limit", "by the interrupt"); None when it ended by itself.

    Returns:
        (data, problems): a problem each for where it stopped early, each failing test, no test run or passed, and
        an exit status that no failing test explains.
    """
    found = read_outcomes(path)
    data = {key: found[key] for key in (*COUNTS, "failing", "collected") if found[key] is not None}
    failing = [f"failed: {name}" for name in found["failing"]]
    if found["ended"]:  # every test ran (one killed was cut on its way out: its counts are whole)
        if not found["tests"]:
            return {}, [f"pytest ran no test (exit status {returncode})"]
        if data["passed"] == 0:
            return data, [*failing, f"no test passed ({data['skipped']} skipped)"]
        if returncode and not failing:
            return data, [f"pytest exit status {returncode}"]
        return data, failing
    if cut_by is None and not found["tests"] and not found["running"]:
        return {}, [f"pytest wrote no results (exit status {returncode})"]  # it stopped before its first test
    data["cut"] = _cut(found, cut_by or "by a crash")
    stopped = (
        f"cut {data['cut']['text']}" if cut_by else f"pytest ended (exit status {returncode}) {data['cut']['text']}"
    )
    return data, [stopped, *failing]


def _cut(found: dict[str, Any], by: str) -> dict[str, Any]:
    """Where a test run stopped before its end: after how many tests, of how many, in which."""
    if found["collected"] is None and not found["tests"] and not found["running"]:
        text = f"{by} before its first test (pytest was starting or collecting)"
    else:
        of = f" of {found['collected']}" if found["collected"] is not None else ""
        text = f"{by} after {found['tests']}{of} tests" + (f", in {found['running']}" if found["running"] else "")
    return {"by": by, "after_tests": found["tests"], "running": found["running"], "text": text}
