"""Benchmark systems each run in a process of their own: a system that crashes or runs past its limit is reported as
such (its processes killed), the others still report, and every result is one JSON line printed as it finishes."""

from __future__ import annotations

import json
import os
import textwrap
import time

import pytest

from rollout.benchmarks.isolated import run_system

SYSTEMS = textwrap.dedent(
    """
    import os, sys, time

    def measure(system, seconds=0.0, pid_file=None):
        if pid_file:
            open(pid_file, "w").write(str(os.getpid()))
        if system == "crash":
            raise RuntimeError("the model fell over")
        time.sleep(seconds)
        print("progress that is not a result", file=sys.stderr)
        return {"tokens_per_s": 123.0}
    """
)


@pytest.fixture
def fake_benchmark(tmp_path, monkeypatch) -> str:
    """A benchmark module the child processes can import (they inherit PYTHONPATH)."""
    (tmp_path / "fake_systems.py").write_text(SYSTEMS)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return "fake_systems:measure"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_each_system_reports_one_json_line_as_it_finishes(fake_benchmark, tmp_path, capsys):
    fast = run_system(fake_benchmark, "fast", {}, 60, log_dir=tmp_path / "logs")
    crash = run_system(fake_benchmark, "crash", {}, 60)
    pid_file = tmp_path / "hang.pid"
    started = time.monotonic()
    hang = run_system(fake_benchmark, "hang", {"seconds": 600, "pid_file": str(pid_file)}, 3)
    after = run_system(fake_benchmark, "after", {}, 60)
    assert time.monotonic() - started < 60  # the hang was cut at its own limit, not waited out
    assert fast == {"system": "fast", "tokens_per_s": 123.0, "status": "ok"}
    assert crash["status"] == "failed" and "the model fell over" in crash["error"]
    assert hang["status"] == "timeout" and hang["seconds"] >= 3
    assert _gone(int(pid_file.read_text()))  # killed with everything it started
    assert after["status"] == "ok"  # a failed or timed-out system does not stop the next
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["system"] for line in lines] == ["fast", "crash", "hang", "after"]
    assert "progress that is not a result" in (tmp_path / "logs" / "fake_systems_measure-fast.log").read_text()


def test_an_unknown_benchmark_is_a_failure_naming_it(capsys):
    result = run_system("no-such-benchmark", "rollout", {}, 60)
    assert result["status"] == "failed" and "unknown benchmark 'no-such-benchmark'" in result["error"]
