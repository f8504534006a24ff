"""`rollout-bench gpu-report`'s test sections keep their counts when pytest does not reach its end (killed at the
section's time limit, interrupted, crashed): each test's outcome is written as it finishes
(`harness/pytest_outcomes.py`), and the counts are checked against pytest's own JUnit XML for the same tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from test_gpu_report import MACHINE

from rollout.benchmarks.gpu_report import report as gpu_report
from rollout.benchmarks.harness import pytest_outcomes
from rollout.process_groups import interrupt_on_signals

# Every outcome a test can have, once each; the last two never finish in time.
SAMPLE = """
import os, signal, time
import pytest

@pytest.fixture
def broken_setup():
    raise RuntimeError("setup broke")

@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke")

def test_passes(): assert True
def test_fails(): assert 1 == 2, "one is not two"
@pytest.mark.skip(reason="not here")
def test_skipped(): pass
@pytest.mark.xfail(reason="known")
def test_expected_failure(): assert False
def test_setup_error(broken_setup): pass
def test_teardown_error(broken_teardown): pass
def test_fails_then_teardown_error(broken_teardown): assert False, "call broke"
@pytest.mark.parametrize("n", [1, 2])
def test_passes_twice(n): assert n
def test_the_end(): {the_end}
def test_never_reached(): pass
"""
FINISHED = 9  # the tests before test_the_end
HANG = "time.sleep(600)"


def _sample(tmp_path: Path, the_end: str) -> Path:
    path = tmp_path / "test_sample.py"
    path.write_text(textwrap.dedent(SAMPLE.format(the_end=the_end)))
    return path


def _pytest(path: Path, *extra: str) -> tuple[str, ...]:
    """pytest on a sample file, its ids relative to the sample's folder: without --rootdir, pytest takes the common
    ancestor of the file and the working directory (/tmp, for a checkout under /tmp, as CI's)."""
    rootdir = f"--rootdir={path.parent}"
    return (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", rootdir, str(path), *extra)


def _junit_reference(path: Path, tmp_path: Path) -> dict[str, int]:
    """pytest's own counts of the tests before test_the_end, run to its end with --junitxml: each test by its worst
    outcome (JUnit XML has a failing test that also errors in teardown twice, as a failure and an error)."""
    junit = tmp_path / "reference.xml"
    subprocess.run(
        [*_pytest(path, "-k", "not the_end and not never_reached", f"--junitxml={junit}")],
        capture_output=True,
        timeout=120,
    )
    worst: dict[str, str] = {}
    order = ("passed", "skipped", "errors", "failed")
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcome = next(
            (o for tag, o in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")) if tag in tags),
            "passed",
        )
        if order.index(outcome) >= order.index(worst.get(test, "passed")):
            worst[test] = outcome
    return {key: sum(outcome == key for outcome in worst.values()) for key in order} | {"tests": len(worst)}


def _run(tmp_path: Path, path: Path, timeout_s: float = 120, **section_fields) -> tuple[int, dict, str]:
    section = gpu_report.Section("kernel-tests", "sample tests", _pytest(path), timeout_s, tests=True, **section_fields)
    out = tmp_path / "report"
    with open(os.devnull, "w") as devnull:
        status = gpu_report.run_report([section], out, MACHINE, devnull)
    report = json.loads((out / "gpu_report.json").read_text())
    return status, report, (out / "gpu_report.md").read_text()


def test_a_test_section_cut_at_its_time_limit_keeps_its_counts(tmp_path):
    """pytest killed at the section's limit in its 10th of 11 tests: the 9 it finished are counted as pytest's own
    JUnit XML counts them, their failures named, and the report says where it was cut."""
    path = _sample(tmp_path, HANG)
    status, report, markdown = _run(tmp_path, path, timeout_s=12)
    assert status == 1
    section = report["sections"]["kernel-tests"]
    data = section["data"]
    reference = _junit_reference(path, tmp_path)
    assert reference["tests"] == FINISHED
    assert {key: data[key] for key in reference} == reference
    assert (data["passed"], data["failed"], data["errors"], data["skipped"]) == (3, 2, 2, 2)  # the sample's own
    assert data["collected"] == 11 and data["cut"]["after_tests"] == FINISHED
    assert section["status"] == "timeout"
    cut = "cut at the time limit after 9 of 11 tests, in test_sample.py::test_the_end"
    assert cut in section["error"]
    for failing in (
        "test_sample.py::test_fails: AssertionError: one is not two",
        "test_sample.py::test_setup_error: RuntimeError: setup broke",
        "test_sample.py::test_teardown_error: RuntimeError: teardown broke",
        "test_sample.py::test_fails_then_teardown_error: AssertionError: call broke",  # once, as failed
    ):
        assert f"failed: {failing}" in section["error"] and failing in data["failing"]
    assert len(data["failing"]) == 4
    row = "| kernel-tests | sample tests | 3 passed, 2 failed, 2 errors, 2 skipped (CUT at the time limit after 9 of 11"
    assert row in markdown and "| <= 0 failures: MISSED |" in markdown
    lines = (tmp_path / "report" / "kernel-tests.outcomes.jsonl").read_text().splitlines()
    assert json.loads(lines[-1]) == {"event": "start", "test": "test_sample.py::test_the_end"}


def test_a_cut_run_without_failures_gets_no_verdict(tmp_path):
    """Cut short with every finished test passing: the goal "no failing test" is not met by the tests not run."""
    path = tmp_path / "test_slow.py"
    path.write_text("import time\ndef test_quick(): pass\ndef test_slow(): time.sleep(600)\n")
    status, report, markdown = _run(tmp_path, path, timeout_s=10)
    data = report["sections"]["kernel-tests"]["data"]
    assert status == 1 and (data["tests"], data["passed"], data["collected"]) == (1, 1, 2)
    assert "1 passed, 0 failed, 0 errors, 0 skipped (CUT at the time limit after 1 of 2 tests" in markdown
    assert "| <= 0 failures: not measured |" in markdown
    goal = next(g for g in report["goals"] if g["section"] == "kernel-tests")
    assert goal["met"] is None


def test_a_pytest_that_crashes_keeps_the_tests_before_the_crash(tmp_path):
    """A test that kills pytest (as a fault in a CUDA kernel would, SIGSEGV): the section fails, names the test it
    died in, and keeps the counts of those before it."""
    path = _sample(tmp_path, "os.kill(os.getpid(), signal.SIGSEGV)")
    status, report, _ = _run(tmp_path, path)
    section = report["sections"]["kernel-tests"]
    assert status == 1 and section["status"] == "failed"
    reference = _junit_reference(path, tmp_path)
    assert {key: section["data"][key] for key in reference} == reference
    died = (
        f"pytest ended (exit status {-signal.SIGSEGV}) by a crash after 9 of 11 tests, in test_sample.py::test_the_end"
    )
    assert died in section["error"]


def test_a_finished_run_counts_as_pytests_junit_xml_does(tmp_path):
    """Run to its end, the section's counts are pytest's JUnit XML's, and its outcome log says pytest ended."""
    path = _sample(tmp_path, "pass")
    status, report, _ = _run(tmp_path, path)
    section = report["sections"]["kernel-tests"]
    assert status == 1 and section["status"] == "failed" and "cut" not in section["data"]
    junit = tmp_path / "all.xml"
    subprocess.run([*_pytest(path, f"--junitxml={junit}")], capture_output=True, timeout=120)
    suite = ElementTree.parse(junit).getroot().find("testsuite")
    assert section["data"]["tests"] == section["data"]["collected"] == 11
    # JUnit's suite counts the failing test that also errors in teardown twice; the section counts each test once.
    assert int(suite.get("tests")) == 12 and int(suite.get("skipped")) == section["data"]["skipped"]
    assert int(suite.get("failures")) == section["data"]["failed"]
    assert int(suite.get("errors")) == section["data"]["errors"] + 1
    found = pytest_outcomes.read_outcomes(tmp_path / "report" / "kernel-tests.outcomes.jsonl")
    assert found["ended"] and found["running"] is None


def test_a_section_whose_tests_all_skip_fails_unless_its_skips_are_expected(tmp_path):
    """GPU tests on a CPU all skip: on the GPU that is a failure ("no test passed"); in a CPU rehearsal, whose
    section says why they may, it is reported skipped with that reason. Each skip's reason is in the outcome log."""
    path = tmp_path / "test_gpu_only.py"
    path.write_text(
        "import pytest\n"
        "@pytest.mark.skip(reason='needs a CUDA device')\ndef test_one(): pass\n"
        "def test_two(): pytest.skip('needs a CUDA device too')\n"
    )
    status, report, _ = _run(tmp_path, path)
    section = report["sections"]["kernel-tests"]
    assert status == 1 and section["status"] == "failed" and "no test passed (2 skipped)" in section["error"]
    lines = (tmp_path / "report" / "kernel-tests.outcomes.jsonl").read_text().splitlines()
    reasons = [json.loads(line)["message"] for line in lines if json.loads(line).get("event") == "finish"]
    assert reasons == ["needs a CUDA device", "needs a CUDA device too"]
    status, report, markdown = _run(tmp_path, path, skips_expected="a CPU rehearsal")
    section = report["sections"]["kernel-tests"]
    assert section["status"] == "skipped" and section["error"] == "not run: a CPU rehearsal"
    assert section["data"]["skipped"] == section["data"]["tests"] == 2


def test_the_outcome_log_skips_what_is_not_a_line_of_it(tmp_path):
    """A line cut short as the process was killed, or anything else in the file, is passed over."""
    log = tmp_path / "outcomes.jsonl"
    finish = {"event": "finish", "test": "t.py::a", "outcome": "passed", "seconds": 0.1, "message": None}
    log.write_text(
        json.dumps({"event": "collected", "count": 3})
        + "\n[1, 2]\n"
        + json.dumps(finish)
        + "\n"
        + json.dumps({**finish, "test": "t.py::b", "outcome": "weird"})
        + '\n{"event": "start", "test": "t.py::c"}\n{"event": "fin'
    )
    found = pytest_outcomes.read_outcomes(log)
    assert (found["tests"], found["passed"], found["collected"], found["running"]) == (1, 1, 3, "t.py::c")
    assert pytest_outcomes.read_outcomes(tmp_path / "missing.jsonl")["tests"] == 0


def test_an_interrupted_test_section_keeps_its_counts(tmp_path):
    """SIGTERM to the report while a test hangs (as `rollout-bench` sets signals up): the section is interrupted,
    keeps the tests that finished and says where it stopped; no verdict, as no test passed."""
    path = tmp_path / "test_wait.py"
    started = tmp_path / "started"
    path.write_text(
        "import pytest, time\n@pytest.mark.skip(reason='not here')\ndef test_skipped(): pass\n"
        f"def test_waits():\n    open({str(started)!r}, 'w').close()\n    time.sleep(600)\n"
    )

    def interrupt_once_started():
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    section = gpu_report.Section("gpu-tests", "waiting tests", _pytest(path), 300, tests=True)
    out = tmp_path / "report"
    previous = interrupt_on_signals()
    try:
        threading.Thread(target=interrupt_once_started, daemon=True).start()
        with open(os.devnull, "w") as devnull:
            assert gpu_report.run_report([section], out, MACHINE, devnull) == 130
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    report = json.loads((out / "gpu_report.json").read_text())
    kept = report["sections"]["gpu-tests"]
    assert kept["status"] == "interrupted" and (kept["data"]["tests"], kept["data"]["skipped"]) == (1, 1)
    assert "cut by the interrupt after 1 of 2 tests, in test_wait.py::test_waits" in kept["error"]
    assert next(g for g in report["goals"] if g["section"] == "gpu-tests")["met"] is None
