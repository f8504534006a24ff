"""rollout-bench runs cut short: a system killed after it printed its result keeps it, a baseline under a short
time budget is told a deadline after its start, and Ctrl-C reports what finished (exit 130, no traceback)."""

from __future__ import annotations

import json
import time

import pytest

from rollout.benchmarks import cli
from rollout.benchmarks.harness.section_run import SectionInterrupted, SectionResult


def test_a_system_killed_after_printing_its_result_keeps_it(tmp_path, monkeypatch):
    """A system whose process hangs on its way out (a non-daemon thread) is killed at its limit, but its result line
    was printed first: its figures stand."""
    from rollout.benchmarks.harness.isolated import run_system

    (tmp_path / "hangs_on_exit.py").write_text(
        "import threading, time\n"
        "def measure(system, **options):\n"
        "    threading.Thread(target=time.sleep, args=(120,)).start()\n"
        "    return {'tokens_per_s': 12.5}\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    start = time.monotonic()
    line = run_system("hangs_on_exit:measure", "x", {}, timeout_s=10, log_dir=tmp_path / "logs")
    assert time.monotonic() - start < 60
    assert line["status"] == "ok" and line["tokens_per_s"] == 12.5


def test_a_short_time_budget_still_lets_a_baseline_start(monkeypatch):
    """A share shorter than the 15 s stop margin: the baseline's deadline is a quarter of its limit before the kill,
    not before its own start."""
    from rollout.benchmarks.throughput import throughput

    asked = []

    def fake_run_system(benchmark, system, options, timeout_s):
        asked.append((options["deadline"] - time.monotonic(), timeout_s))
        return {"system": system, "status": "ok", "tokens_per_s": 1.0, "seconds": 1.0, "warmup_s": 0.0}

    monkeypatch.setattr(throughput, "run_system", fake_run_system)
    monkeypatch.setattr(throughput, "_print_table", lambda summary: None)
    throughput.run("cpu-small", ["transformers_generate"], time_budget_s=12)
    stop_in, limit = asked[0]
    assert abs(limit - 12) < 1 and abs(stop_in - 0.75 * limit) < 1


def test_ctrl_c_during_throughput_reports_the_systems_that_finished(monkeypatch, capsys):
    from rollout.benchmarks.throughput import throughput

    def fake_run_system(benchmark, system, options, timeout_s):
        if system == "transformers_generate":
            raise SectionInterrupted(SectionResult("throughput-x", system, "interrupted", 2.0))
        line = {"system": system, "status": "ok", "tokens_per_s": 10.0, "seconds": 1.0, "warmup_s": 0.0}
        return {**line, "generated_tokens": 10, "token_digests": ["a"]}

    monkeypatch.setattr(throughput, "run_system", fake_run_system)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["throughput", "--systems", "rollout", "transformers_generate", "--details", "--num-prompts", "1"])
    assert stopped.value.code == 130
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["interrupted"] and summary["results"]["rollout"]["tokens_per_s"] == 10.0
    assert summary["results"]["transformers_generate"]["status"] == "interrupted" and "details" not in summary
    assert "INTERRUPTED" in captured.out and "Traceback" not in captured.err


@pytest.mark.parametrize("speculative", [[], ["--speculative", "suffix", "--repeats", "2"]])
def test_ctrl_c_during_long_tail_reports_what_finished(monkeypatch, capsys, speculative):
    from rollout.engine.engine import Engine

    step, calls = Engine.step, []

    def interrupted_step(self):
        calls.append(1)
        if len(calls) == 20:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Engine, "step", interrupted_step)
    flags = ["--num-prompts", "4", "--n", "2", "--median-tokens", "64", "--max-tokens", "256", "--seed", "1"]
    with pytest.raises(SystemExit) as stopped:
        cli.main(["long-tail", *flags, *speculative])
    assert stopped.value.code == 130
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run = summary.get("without", summary)
    assert summary["interrupted"] and run["interrupted"] and run["steps"] >= 19 and not run["finished"]
    assert run["generated_tokens"] > 0
