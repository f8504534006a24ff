"""`rollout-bench gpu-report` when time runs out, on CPU with real subprocesses: a budget shares the call out (each
section keeps its least time, one that cannot is skipped), a section cut short or interrupted keeps what it had
printed, and ratios are taken across sections."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time

import pytest
from test_gpu_report import MACHINE, _gone, _grandchild_code, _section

from rollout.benchmarks.gpu_report import report as gpu_report
from rollout.process_groups import interrupt_on_signals


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_report_kills_its_section_and_keeps_what_it_printed(tmp_path, signum):
    """SIGINT or SIGTERM while a section runs (as `rollout-bench` sets them up): the section is killed with what it
    started, the systems it had finished stay in the report, and no later section starts."""
    started = tmp_path / "started.pid"
    line = {"system": "rollout", "status": "ok", "workload": "nano", "tokens_per_s": 20000.0, "measured": "throughput"}
    then = f"import json; print(json.dumps({line!r}), flush=True); time.sleep(600)"
    chosen = [
        gpu_report.Section(
            "throughput", "t", (sys.executable, "-c", _grandchild_code(started, then)), 120, benchmark="throughput"
        ),
        _section("weights", "print('{}')"),
    ]

    def interrupt_once_started():
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # its line printed and read
        os.kill(os.getpid(), signum)

    previous = interrupt_on_signals()
    try:
        threading.Thread(target=interrupt_once_started, daemon=True).start()
        out = tmp_path / "report"
        with open(os.devnull, "w") as devnull:
            assert gpu_report.run_report(chosen, out, MACHINE, devnull) == 130
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    assert _gone(int(started.read_text()))
    report = json.loads((out / "gpu_report.json").read_text())
    assert list(report["sections"]) == ["throughput"] and report["sections"]["throughput"]["status"] == "interrupted"
    assert report["sections"]["throughput"]["data"]["results"]["rollout"]["tokens_per_s"] == 20000.0


def test_a_short_budget_skips_what_it_cannot_start_and_keeps_a_summary_printed_before_a_hang(tmp_path):
    """Under a budget, a section starts only with at least its `reserve_s` left, and is otherwise skipped, said so;
    a section that printed its summary and then hangs on its way out keeps it."""
    summary = {"benchmark": "grpo-step", "results": {"rollout_colocate": {"step_s": 1.5}}}
    chosen = [
        gpu_report.Section(
            "grpo-step-nano",
            "summary, then a hang",
            (sys.executable, "-c", f"import json, time; print(json.dumps({summary!r}), flush=True); time.sleep(600)"),
            3,
            benchmark="grpo-step",
            reserve_s=10,
        ),
        dataclasses.replace(_section("baseline-generate", "print('{}')"), reserve_s=300),  # never fits: skipped
        dataclasses.replace(_section("kernel-tests", "print('{}')"), reserve_s=5),
    ]
    out = tmp_path / "report"
    with open(os.devnull, "w") as devnull:
        assert gpu_report.run_report(chosen, out, MACHINE, devnull, budget_s=60) == 1
    sections = json.loads((out / "gpu_report.json").read_text())["sections"]
    assert sections["grpo-step-nano"]["status"] == "timeout"
    assert sections["grpo-step-nano"]["data"]["results"]["rollout_colocate"]["step_s"] == 1.5
    skipped = sections["baseline-generate"]
    assert skipped["status"] == "skipped" and "less than the 300 s it needs to start" in skipped["error"]
    assert sections["kernel-tests"]["status"] == "ok"
    assert "| grpo-step-nano | rollout_colocate: step s | 1.500 s |" in (out / "gpu_report.md").read_text()


def test_a_budget_cuts_the_sections_and_the_report_keeps_what_finished(tmp_path):
    """--budget-s: a section gets at most what is left (a budgeted command is told its share), the report is written
    after every section, and a later call merges it."""
    told = tmp_path / "told"
    budgeted = gpu_report.Section(
        "throughput",
        "budgeted",
        (sys.executable, "-c", f"import sys; open({str(told)!r}, 'w').write(sys.argv[-1]); print('{{}}')", "--x"),
        600,
        budget_flag="--time-budget",
    )
    chosen = [
        _section("grpo", 'print(\'{"benchmark": "grpo"}\')'),
        budgeted,
        _section("weights", "import time; time.sleep(600)"),
    ]
    out = tmp_path / "first"
    start = time.monotonic()
    with open(os.devnull, "w") as devnull:
        assert gpu_report.run_report(chosen, out, MACHINE, devnull, budget_s=8) == 1
    assert time.monotonic() - start < 40  # the hanging section got only what was left of the 8 s
    assert float(told.read_text()) == 1  # its share less the margin to print its summary (20 s), at least 1 s
    sections = json.loads((out / "gpu_report.json").read_text())["sections"]
    assert [sections[name]["status"] for name in ("grpo", "throughput", "weights")] == ["ok", "ok", "timeout"]
    merged = gpu_report._earlier_results(out / "gpu_report.json")
    other = {**MACHINE, "gpu": "other GPU"}
    weights = [_section("weights", "print('{}')")]
    with open(os.devnull, "w") as devnull:  # the next call (a fresh machine) runs weights again and keeps the rest
        assert gpu_report.run_report(weights, tmp_path / "second", other, devnull, merged=merged) == 0
    sections = json.loads((tmp_path / "second" / "gpu_report.json").read_text())["sections"]
    assert list(sections) == ["throughput", "weights", "grpo"] and sections["weights"]["status"] == "ok"
    # Each figure says which machine it came from: merged sections keep their own.
    assert [sections[name]["machine"]["gpu"] for name in sections] == ["test GPU", "other GPU", "test GPU"]
    markdown = (tmp_path / "second" / "gpu_report.md").read_text()
    assert "| grpo | ok | 0 | test GPU, 2026-11-22 |" in markdown and "| weights | ok | 0 | other GPU" in markdown


def test_a_section_cut_short_keeps_the_systems_it_finished_and_ratios_cross_sections(tmp_path):
    """The headline's sections are separate processes: a throughput section killed at its limit after its rollout
    system finished keeps that system's line (what `isolated.run_system` printed), and each baseline's ratio is
    taken against it; a baseline cut short at its own deadline gets its rate and no verdict on the ratio."""
    rollout = {"system": "rollout", "workload": "nano", "tokens_per_s": 20000.0, "status": "ok"}
    invariant = {**rollout, "system": "rollout_invariant", "tokens_per_s": 12500.0}
    details = {"system": "rollout", "status": "ok", "decode_roofline_fraction": 0.6}
    hang = (
        f"import json, time; print(json.dumps({{**{rollout!r}, 'measured': 'throughput'}}), flush=True); "
        f"print(json.dumps({{**{invariant!r}, 'measured': 'throughput'}}), flush=True); "
        f"print(json.dumps({{**{details!r}, 'measured': 'details'}}), flush=True); time.sleep(600)"
    )

    def baseline(system: str, tokens_per_s: float, cut: dict | None) -> str:
        line = {"system": system, "status": "ok", "tokens_per_s": tokens_per_s, "seconds": 90.0, "cut_short": cut}
        summary = {"benchmark": "throughput", "workload": "nano", "results": {system: line}}
        return f"import json; print(json.dumps({summary!r}))"

    cut = {"finished_requests": 100, "requests": 256, "tokens": 40000, "requested_tokens": 134000}
    chosen = [
        gpu_report.Section("throughput", "t", (sys.executable, "-c", hang), 3, benchmark="throughput"),
        _section("baseline-generate-batch", baseline("transformers_generate_batch", 2500.0, None)),
        _section("baseline-generate", baseline("transformers_generate", 444.4, cut)),
    ]
    out = tmp_path / "report"
    with open(os.devnull, "w") as devnull:
        assert gpu_report.run_report(chosen, out, MACHINE, devnull) == 1  # the throughput section timed out
    report = json.loads((out / "gpu_report.json").read_text())
    kept = report["sections"]["throughput"]
    assert kept["status"] == "timeout" and kept["data"]["partial"] is True
    assert kept["data"]["results"]["rollout"]["tokens_per_s"] == 20000.0
    assert kept["data"]["details"]["decode_roofline_fraction"] == 0.6
    goals = {g["figure"]: g for g in report["goals"]}
    assert goals["rollout tokens/s"]["met"] is True and goals["decode roofline fraction"]["met"] is True
    assert goals["rollout vs transformers_generate_batch"]["value"] == 8.0
    assert goals["rollout vs transformers_generate_batch"]["met"] is True
    price = goals["batch_invariant price (rollout / rollout_invariant tokens/s)"]  # against its 1.25x goal
    assert (price["value"], price["met"]) == (1.6, False)
    markdown = (out / "gpu_report.md").read_text()
    assert "| baseline-generate | transformers_generate tokens/s | 444 (CUT SHORT after 90.0 s: 100 of 256" in markdown
    assert "| baseline-generate | rollout vs transformers_generate | 45.00x over what the baseline finished" in markdown
    assert "| logprob \\|rollout - teacher-forced\\| mean, default | not measured |" in markdown  # one cell


def test_a_section_whose_systems_did_not_finish_fails_and_names_them(tmp_path):
    """A benchmark prints its summary and exits 0 when one of its systems timed out or failed (throughput's rollout
    killed at its share, grpo-step's colocated run an error): the section fails, naming each, instead of an "ok"
    whose figures read "not measured"; a baseline cut short at its own deadline still counts as finished."""
    timed_out = {"system": "rollout", "status": "timeout", "seconds": 77.0, "error": "killed after 77 s\n[ 6.6 s] x"}
    cut = {"finished_requests": 0, "requests": 64, "tokens": 0, "requested_tokens": 8093}
    baseline = {"system": "transformers_generate", "status": "ok", "tokens_per_s": 1.0, "cut_short": cut}
    throughput = {
        "benchmark": "throughput",
        "workload": "cpu-small",
        "results": {"rollout": timed_out, "transformers_generate": baseline},
        "details": {"system": "rollout", "status": "failed", "seconds": 3.0, "error": "RuntimeError: boom"},
    }
    grpo_step = {"benchmark": "grpo-step", "results": {"rollout_colocate": {"error": "timeout: killed after 150 s"}}}
    finished = {"benchmark": "throughput", "workload": "cpu-small", "results": {"transformers_generate": baseline}}

    def printing(name: str, benchmark: str, summary: dict) -> gpu_report.Section:
        return gpu_report.Section(
            name, name, (sys.executable, "-c", f"print({json.dumps(summary)!r})"), 60, benchmark=benchmark
        )

    chosen = [
        printing("throughput", "throughput", throughput),
        printing("baseline-generate", "throughput", finished),
        printing("grpo-step-nano", "grpo-step", grpo_step),
    ]
    out = tmp_path / "report"
    with open(os.devnull, "w") as devnull:
        assert gpu_report.run_report(chosen, out, MACHINE, devnull) == 1
    report = json.loads((out / "gpu_report.json").read_text())
    sections = report["sections"]
    assert report["ok"] is False
    assert [sections[name]["status"] for name in ("throughput", "baseline-generate", "grpo-step-nano")] == [
        "failed",
        "ok",
        "failed",
    ]
    error = sections["throughput"]["error"]
    assert "rollout: timeout (killed after 77 s)" in error and "details: failed (RuntimeError: boom)" in error
    assert "rollout_colocate: failed (timeout: killed after 150 s)" in sections["grpo-step-nano"]["error"]
    assert sections["throughput"]["data"]["results"]["rollout"]["status"] == "timeout"  # the summary is kept
    markdown = (out / "gpu_report.md").read_text()
    assert "### throughput (failed)" in markdown and "not every system finished: rollout: timeout" in markdown


def test_a_section_that_runs_to_its_limit_leaves_the_next_its_least_time(tmp_path):
    """Under a budget, a section that hangs until it is killed at its share still leaves the section after it the
    `reserve_s` it was kept (its kill and the drain of its output come out of its own share), so the later one runs
    rather than being skipped a fraction of a second short."""
    hang = dataclasses.replace(_section("speculative", "import time; time.sleep(600)"), reserve_s=1)
    last = dataclasses.replace(_section("kernel-tests", "print('{}')"), reserve_s=6)
    out = tmp_path / "report"
    with open(os.devnull, "w") as devnull:
        assert gpu_report.run_report([hang, last], out, MACHINE, devnull, budget_s=13) == 1
    sections = json.loads((out / "gpu_report.json").read_text())["sections"]
    assert sections["speculative"]["status"] == "timeout"
    assert sections["kernel-tests"]["status"] == "ok", sections["kernel-tests"]["error"]
