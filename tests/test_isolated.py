"""Benchmark systems each run in a process of their own: a system that crashes or runs past its limit is reported as
such (its processes killed), the others still report, and every result is one JSON line printed as it finishes, on
stderr and once (stdout is the benchmark's summary's alone)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rollout.benchmarks.harness.isolated import run_system

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
    assert fast == {"system": "fast", "tokens_per_s": 123.0, "status": "ok", "measured": fake_benchmark}
    assert crash["status"] == "failed" and "the model fell over" in crash["error"]
    assert hang["status"] == "timeout" and hang["seconds"] >= 3
    assert _gone(int(pid_file.read_text()))  # killed with everything it started
    assert after["status"] == "ok"  # a failed or timed-out system does not stop the next
    captured = capsys.readouterr()
    # stdout is left to the benchmark's summary, which holds every result: printed there too, each came twice
    assert captured.out == ""
    lines = [json.loads(line) for line in captured.err.splitlines() if line.startswith("{")]
    assert [line["system"] for line in lines] == ["fast", "crash", "hang", "after"]
    assert '| {"system": ' not in captured.err  # the child's own result line is not echoed: each result once
    assert "fake_systems_measure-fast | progress that is not a result" in captured.err
    assert "progress that is not a result" in (tmp_path / "logs" / "fake_systems_measure-fast.log").read_text()


def test_an_unknown_benchmark_is_a_failure_naming_it(capsys):
    result = run_system("no-such-benchmark", "rollout", {}, 60)
    assert result["status"] == "failed" and "unknown benchmark 'no-such-benchmark'" in result["error"]


def _wait_for(path, seconds: float = 60.0) -> int:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.05)
    return int(path.read_text())


def _gone_within(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/status").read()
        except FileNotFoundError:
            return True
        if "zombie" in state:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_system_ends_with_the_process_that_runs_it(fake_benchmark, tmp_path):
    """A system runs in a session of its own, out of reach of signals to its runner's group: killed outright (no
    `finally` runs: SIGKILL, a device's time limit), the runner still takes the system down with it."""
    pid_file = tmp_path / "system.pid"
    code = (
        "from rollout.benchmarks.harness.isolated import run_system\n"
        f"run_system({fake_benchmark!r}, 'hang', {{'seconds': 600, 'pid_file': {str(pid_file)!r}}}, 600)"
    )
    runner = subprocess.Popen([sys.executable, "-c", code])
    try:
        system = _wait_for(pid_file)
        runner.kill()
        runner.wait()
        assert _gone_within(system)
    finally:
        runner.kill()
        runner.wait()


def test_sigint_ends_a_benchmark_started_with_it_ignored(tmp_path):
    """A shell starts background jobs with SIGINT ignored: `rollout-bench` still unwinds on SIGINT (and SIGTERM),
    killing the system it runs, in its own process group, on the way out."""
    command = [sys.executable, "-m", "rollout.benchmarks.cli", "throughput", "--workload", "cpu-small"]
    command += ["--systems", "transformers_generate", "--repeats", "3", "--num-prompts", "8"]
    bench = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        for line in bench.stderr:  # the system's process has started once it reports building its model
            if "building the cpu-small model" in line:
                break
        children = Path(f"/proc/{bench.pid}/task/{bench.pid}/children").read_text().split()
        assert children, "the system's process is not running"
        bench.send_signal(signal.SIGINT)
        assert bench.wait(timeout=60) != 0
        assert all(_gone_within(int(pid)) for pid in children)
    finally:
        bench.kill()
        bench.wait()
        bench.stderr.close()


def test_workers_that_ignore_sigterm_are_killed_when_stopped():
    """A benchmark's worker subprocesses are stopped together: SIGTERM, then SIGKILL for one that ignores it after
    the time given (the service, agentic and grpo-step benchmarks waited, then raised TimeoutExpired and left it
    running)."""
    import subprocess
    import sys
    import time

    from rollout.benchmarks.harness.worker_probe import stop_workers

    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        for code in (stubborn, "import time; print(1, flush=True); time.sleep(60)")
    ]
    for process in processes:
        process.stdout.readline()  # its signal handler is set
    started = time.monotonic()
    stop_workers(processes, timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert [process.returncode for process in processes] == [-9, -15]
    for process in processes:
        process.stdout.close()
