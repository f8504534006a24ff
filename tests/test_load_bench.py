"""`rollout-bench load` stays runnable and honest: a tiny run (3 clients x 3 groups of n=2 against a real worker
subprocess) returns every group exactly once and leaves no KV block in use; with two workers, SIGKILLing one
mid-run loses nothing (while the other is fuzzed); impossible flags are usage errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)

TINY = "--clients 3 --groups 3 --n 2 --prompt-len 8 --max-new-tokens 4 --num-blocks 256".split()


def _bench(*flags: str, module: str = "rollout.benchmarks.cli", timeout: float = 200) -> tuple[dict, str]:
    """Run `rollout-bench load` in a fresh process (it forks its clients); the JSON line and the output. Module
    rollout.benchmarks.load runs the same without importing the other benchmarks (torch)."""
    command = [sys.executable, "-m", module, *(["load"] if module.endswith(".cli") else []), *flags]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), out[-4000:]
    summary = json.loads(lines[-1])
    assert done.returncode == (0 if summary["passed"] else 1), out[-4000:]
    return summary, out


def test_killing_one_of_two_workers_mid_run_loses_nothing_while_the_other_is_fuzzed():
    # Killed as soon as it has groups in flight; its clients give up on it after 2 s and resubmit them to the other
    # worker, which meanwhile gets 300 malformed messages.
    kill = "--groups 4 --max-new-tokens 48 --workers 2 --kill-one --kill-at 0 --dead-after 2 --fuzz 300".split()
    summary, out = _bench(*TINY, *kill, module="rollout.benchmarks.load")
    assert summary["kill"] is not None and summary["worker"][0]["killed"], out[-4000:]
    assert summary["kill"]["groups_in_flight_on_it"] > 0, summary["kill"]  # killed at once: it had work
    assert summary["passed"] and summary["exactly_once"], out[-4000:]
    assert (summary["groups_returned"], summary["lost"], summary["duplicated"]) == (12, 0, 0)
    assert summary["worker"][1]["kv_blocks_used_end"] == 0
    fuzz = summary["fuzz"]
    assert fuzz["sent"] == fuzz["answered"] == 300 and fuzz["unanswered"] == 0, fuzz
    assert fuzz["serving"]["hello"] and fuzz["greedy_unchanged"], fuzz["serving"]
    # What every load run reports (one run here: a suite on 2 cores has no time for two).
    assert summary["unexpected"] == summary["malformed_results"] == 0
    assert summary["groups_per_s"] > 0 and 0 < summary["latency_p50_s"] <= summary["latency_p99_s"]
    survivor = summary["worker"][1]
    assert 0 < survivor["rss_start_mb"] <= survivor["rss_peak_mb"] and survivor["rss_end_mb"] > 0
    assert "exactly once" in out and "KV blocks in use at end" in out  # the table, before the JSON line


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kill-one"], "--kill-one needs --workers 2"),
        (["--clients", "0"], "must be >= 1"),
        (["--kill-at", "1.5"], "--kill-at must be in [0, 1)"),
    ],
)
def test_impossible_flags_are_usage_errors(flags, message, capsys):
    from rollout.benchmarks import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["load", *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err
