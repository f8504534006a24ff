"""`rollout-bench gpu-report` orchestration on CPU: argument handling, the no-GPU stop, the sections being valid
`rollout-bench` / pytest commands, and a report assembled from real subprocesses (a real pytest run with a failing
test, a real `rollout-bench weights` run, a crash and a hang)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from rollout.benchmarks import cli, gpu_report
from rollout.process_groups import interrupt_on_signals

TESTS_DIR = Path(__file__).parent


def _parse(argv: list[str]):
    parser = cli.build_parser()
    return parser, parser.parse_args(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_stops_at_once_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "report"
    with pytest.raises(SystemExit) as stop:
        cli.main(["gpu-report", "--out", str(out), "--tests-dir", str(TESTS_DIR)])
    assert stop.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--only", "throughput", "--skip", "grpo"], "not allowed with argument"),
        (["--only", "nano"], "invalid choice: 'nano'"),
        (["--skip", *gpu_report.SECTION_NAMES], "leaves no section to run"),
        (["--tests-dir", "/nonexistent"], "--tests-dir /nonexistent has no gpu/ folder"),
        (["--json"], "--json goes with --plan"),
        (["--plan", "--only", "throughput", "--budget-s", "9"], "leave out --only, --budget-s"),
        (["--workload", "cpu-bf16"], "invalid choice: 'cpu-bf16'"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        parser, args = _parse(["gpu-report", *argv])
        gpu_report.main(args, parser)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_without_test_sections_no_tests_folder_is_needed(monkeypatch):
    """--skip of both test sections runs from anywhere (an installed package has no tests/ folder)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # stop right after argument checks
    parser, args = _parse(["gpu-report", "--tests-dir", "/nonexistent", "--skip", "gpu-tests", "kernel-tests"])
    assert gpu_report.main(args, parser) == 2


@pytest.mark.parametrize("workload", ["nano", "cpu-small"])
def test_every_section_is_a_valid_command_of_the_issue(workload):
    """Each section is a `rollout-bench` command of its own parser (or pytest on existing test files); cpu-small, the
    rehearsal, runs the same commands on the CPU shapes."""
    chosen = {s.name: s for s in gpu_report.sections(TESTS_DIR, workload=workload)}
    assert tuple(chosen) == gpu_report.SECTION_NAMES
    parser = cli.build_parser()
    bench = {name: parser.parse_args(list(s.argv[3:])) for name, s in chosen.items() if not s.tests}
    device = "cuda" if workload == "nano" else "cpu"
    for name, systems in (
        ("throughput", ["rollout"]),
        ("baseline-generate-batch", ["transformers_generate_batch"]),
        ("baseline-generate", ["transformers_generate"]),
        ("overlap", ["rollout_sequential"]),
    ):
        assert (bench[name].workload, bench[name].systems, bench[name].repeats) == (workload, systems, 1)
        assert chosen[name].budget_flag == "--time-budget"  # each stops itself inside its share of the call
    assert bench["throughput"].details and not bench["baseline-generate"].details
    assert bench["grpo"].device == device and not bench["grpo"].no_transformers
    assert bench["grpo-step"].device == device and bench["grpo-step"].systems is None  # all four
    colocated = bench["grpo-step-nano"]
    shape = ("nano", 3) if workload == "nano" else ("tiny", 1)
    assert (colocated.device, colocated.systems, (colocated.model, colocated.steps)) == (
        device,
        ["rollout_colocate"],
        shape,
    )
    weights = bench["weights"]
    assert (weights.device, weights.dtype, weights.size_mb) == (device, "bfloat16", 1200)
    assert weights.transports == ["frames", "shm"]
    for name in ("gpu-tests", "kernel-tests"):
        paths = [Path(a) for a in chosen[name].argv if a.startswith(str(TESTS_DIR))]
        assert paths and all(p.exists() for p in paths)
    gpu_tests = chosen["gpu-tests"].argv
    assert ("-m", "gpu") in zip(gpu_tests, gpu_tests[1:])  # overrides the default `-m 'not gpu'`


def _section(name: str, code: str, timeout_s: float = 120, tests: bool = False) -> gpu_report.Section:
    argv = (sys.executable, "-m", "pytest", "-q", code) if tests else (sys.executable, "-c", code)
    return gpu_report.Section(name, name, argv, timeout_s, tests)


MACHINE = {"date": "2026-11-22", "gpu": "test GPU", "torch": torch.__version__}


def test_report_from_real_sections_names_every_failure(tmp_path):
    """A real pytest run (one pass, one fail, one skip), a real weights benchmark, a crash and a hang: the report
    counts the tests, names the failing one, keeps the benchmark's figures, and exits 1."""
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(
        textwrap.dedent(
            """
            import pytest
            def test_passes(): assert True
            def test_fails(): assert 1 == 2, "one is not two"
            @pytest.mark.skip(reason="not here")
            def test_skipped(): pass
            """
        )
    )
    grandchild = tmp_path / "grandchild.pid"
    hang = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(grandchild)!r}, 'w').write(str(child.pid)); print('started', flush=True); time.sleep(600)"
    )
    bench = (sys.executable, "-m", "rollout.benchmarks.cli", "weights", "--device", "cpu", "--dtype", "bfloat16")
    chosen = [
        gpu_report.Section(
            "gpu-tests", "sample tests", (sys.executable, "-m", "pytest", "-q", str(test_file)), 120, True
        ),
        gpu_report.Section(
            "weights", "weights", (*bench, "--size-mb", "30", "--transports", "frames", "shm", "--repeats", "1"), 240
        ),
        _section("grpo", "print('about to fail', flush=True); raise SystemExit(3)"),
        _section("throughput", hang, timeout_s=3),
    ]
    out = tmp_path / "report"
    log = (tmp_path / "console.txt").open("w+")
    start = time.monotonic()
    assert gpu_report.run_report(chosen, out, MACHINE, log) == 1
    assert time.monotonic() - start < 200

    report = json.loads((out / "gpu_report.json").read_text())
    sections = report["sections"]
    assert report["ok"] is False and report["environment"] == MACHINE
    assert [sections[n]["status"] for n in ("gpu-tests", "weights", "grpo", "throughput")] == [
        "failed",
        "ok",
        "failed",
        "timeout",
    ]
    assert sections["gpu-tests"]["data"] == {"tests": 3, "passed": 1, "failed": 1, "errors": 0, "skipped": 1}
    assert "test_sample::test_fails" in sections["gpu-tests"]["error"]
    assert "exit status 3" in sections["grpo"]["error"] and "about to fail" in sections["grpo"]["error"]
    weights = sections["weights"]["data"]
    assert weights["dtype"] == "bfloat16" and 24e6 < weights["bytes"] < 36e6
    assert set(weights["results"]) == {"frames", "shm"} and weights["results"]["shm"]["gb_per_s"] > 0
    tests_goal = next(g for g in report["goals"] if g["section"] == "gpu-tests")
    assert tests_goal["met"] is False and tests_goal["value"] == 1
    assert all(g["met"] is None for g in report["goals"] if g["section"] == "throughput")  # timed out: not measured

    # The hang was killed with the process it started.
    pid = int(grandchild.read_text())
    time.sleep(0.5)
    state = Path(f"/proc/{pid}/status")
    assert not state.exists() or "zombie" in state.read_text()

    markdown = (out / "gpu_report.md").read_text()
    assert markdown.startswith("# rollout GPU report: test GPU, 2026-11-22")
    assert "| gpu-tests | sample tests | 1 passed, 1 failed, 0 errors, 1 skipped | <= 0 failures: MISSED |" in markdown
    shm_rate = f"{weights['results']['shm']['gb_per_s']:.2f} GB/s"
    assert f"| weights | shm: {weights['bytes'] / 1e9:.2f} GB bfloat16 pushed | {shm_rate} |" in markdown
    assert "| throughput | decode roofline fraction | not measured |" in markdown  # (its workload unknown: no goal)
    assert "### throughput (timeout)" in markdown and "killed after 3 s" in markdown
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["gpu_report.md", "gpu_report.json", *(f"{s.name}.log" for s in chosen)]
    )
    log.seek(0)
    console = log.read()
    assert "gpu-report [4/4] throughput: timeout" in console and "  weights | " in console


def test_a_clean_run_exits_zero_and_hides_triton_interpret(tmp_path, monkeypatch):
    """Sections run with TRITON_INTERPRET removed, so the kernels compile for real on the GPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    summary = {"benchmark": "grpo", "rollout": {"tokens_per_s": 123.0}, "env": "x"}
    code = (
        "import json, os; print('a table'); "
        f"summary = {summary!r}; summary['env'] = os.environ.get('TRITON_INTERPRET'); print(json.dumps(summary))"
    )
    out = tmp_path / "report"
    with open(os.devnull, "w") as devnull:
        assert gpu_report.run_report([_section("grpo", code)], out, MACHINE, devnull) == 0
    report = json.loads((out / "gpu_report.json").read_text())
    assert report["ok"] is True
    assert report["sections"]["grpo"]["data"] == {**summary, "env": None}
    assert "| grpo | rollout tokens/s (n=8 groups, sampled) | 123 |" in (out / "gpu_report.md").read_text()


def _grandchild_code(pid_file: Path, then: str) -> str:
    """A section that starts a long-lived child, writes its pid, then runs `then`."""
    return (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n{then}"
    )


def _gone(pid: int) -> bool:
    time.sleep(0.5)
    state = Path(f"/proc/{pid}/status")
    return not state.exists() or "zombie" in state.read_text()


def test_sections_that_misbehave_never_hang_or_lose_the_report(tmp_path, monkeypatch):
    """Undecodable bytes and a large output before the summary, a warning after it, a child left running after a
    normal exit, unreadable JUnit XML, a summary of the wrong benchmark or of odd shapes: each section ends promptly
    with a result, the report is written, and nothing a section started is left running."""
    leftover = tmp_path / "leftover.pid"
    summary = json.dumps({"benchmark": "grpo", "rollout": {"tokens_per_s": 5.0}})
    odd = json.dumps({"benchmark": "weights", "bytes": "many", "results": {"frames": [1, 2], "shm": 1.5}})
    chosen = [
        _section(
            "grpo",
            "import sys; sys.stdout.buffer.write(b'\\xff\\xfe bad bytes\\n' + b'x' * 200000 + b'\\n'); "
            f"sys.stdout.flush(); print({summary!r}); print('ResourceWarning: at exit')",
            timeout_s=60,
        ),
        _section("throughput", _grandchild_code(leftover, 'print(\'{"benchmark": "throughput"}\')'), timeout_s=60),
        gpu_report.Section(
            "gpu-tests",
            "junit",
            (sys.executable, "-c", "import sys; open(sys.argv[1][11:], 'w').write('<test')"),
            60,
            True,
        ),
        _section("kernel-tests", 'print(\'{"benchmark": "grpo"}\')'),
        _section("weights", f"print({odd!r})"),
    ]
    chosen[3] = gpu_report.Section("kernel-tests", "wrong", chosen[3].argv, 60, benchmark="throughput")
    out = tmp_path / "report"
    start = time.monotonic()
    with open(os.devnull, "w") as devnull:
        assert gpu_report.run_report(chosen, out, MACHINE, devnull) == 1
    assert time.monotonic() - start < 60
    assert _gone(int(leftover.read_text()))
    sections = json.loads((out / "gpu_report.json").read_text())["sections"]
    assert sections["grpo"]["status"] == "ok" and sections["grpo"]["data"]["rollout"]["tokens_per_s"] == 5.0
    assert sections["throughput"]["status"] == "ok"
    assert sections["gpu-tests"]["status"] == "failed" and "JUnit XML is unreadable" in sections["gpu-tests"]["error"]
    assert sections["kernel-tests"]["status"] == "failed" and "not a 'throughput'" in sections["kernel-tests"]["error"]
    assert sections["weights"]["status"] == "ok"
    markdown = (out / "gpu_report.md").read_text()
    assert "| weights | frames: state dict pushed | not measured |" in markdown
    assert "\ufffd" in (out / "grpo.log").read_text()  # the bad bytes, replaced, not fatal


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


def test_split_runs_merge_into_one_report(tmp_path):
    """`--only` runs into the same folder add up to one report (a section run again replaces its earlier result);
    --fresh (keep_earlier=False) starts over."""
    grpo = _section("grpo", 'print(\'{"benchmark": "grpo"}\')')
    out = tmp_path / "report"
    with open(os.devnull, "w") as devnull:
        assert gpu_report.run_report([grpo], out, MACHINE, devnull) == 0
        assert gpu_report.run_report([_section("throughput", "raise SystemExit(1)")], out, MACHINE, devnull) == 1
        assert list(json.loads((out / "gpu_report.json").read_text())["sections"]) == ["throughput", "grpo"]
        assert gpu_report.run_report([_section("throughput", "print('{}')")], out, MACHINE, devnull) == 0
        assert gpu_report.run_report([grpo], out, MACHINE, devnull, keep_earlier=False) == 0
    assert list(json.loads((out / "gpu_report.json").read_text())["sections"]) == ["grpo"]


def test_out_must_be_a_folder(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(SystemExit):
        parser, args = _parse(["gpu-report", "--out", str(target), "--skip", "gpu-tests", "kernel-tests"])
        gpu_report.main(args, parser)
    assert "is not a folder" in capsys.readouterr().err


def test_rollout_bench_starts_without_the_service_dependencies():
    """The GPU image has no pyzmq or msgpack unless carried: every subcommand but weights must still start."""
    code = (
        "import sys; sys.modules['zmq'] = None; sys.modules['msgpack'] = None\n"
        "from rollout.benchmarks import cli\n"
        "for command in ('throughput', 'grpo', 'gpu-report'):\n"
        "    try:\n        cli.main([command, '--help'])\n    except SystemExit as stop:\n        assert stop.code == 0\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_plan_fits_the_window_by_its_own_json(capsys):
    """`--plan --json`: one headline call of at most 490 s and one optional follow-up, both with their machine starts
    inside the 900 s window; each command at most 2,000 characters, a valid gpu-report command whose sections run
    in the order the issue gives (the report runs them in `sections()` order, so that order must agree)."""
    from rollout.benchmarks.gpu_plan import WHEELS

    with pytest.raises(SystemExit) as stop:
        cli.main(["gpu-report", "--plan", "--json"])
    assert stop.value.code == 0
    plan = json.loads(capsys.readouterr().out)
    calls = plan["calls"]
    assert (plan["device_budget_s"], plan["start_s"], len(calls)) == (900, 90, 2)
    assert sum(call["timeout_s"] + plan["start_s"] for call in calls) <= plan["device_budget_s"]
    assert calls[0]["timeout_s"] <= 490 and not calls[0]["optional"] and calls[1]["optional"]
    assert calls[0]["sections"] == [
        "throughput",
        "baseline-generate-batch",
        "baseline-generate",
        "grpo-step-nano",
        "kernel-tests",
    ]
    order = list(gpu_report.SECTION_NAMES)
    parser = cli.build_parser()
    for number, call in enumerate(calls):
        assert len(call["command"]) <= 2000 and set(call) >= {"title", "timeout_s", "carry", "command"}
        assert [order.index(name) for name in call["sections"]] == sorted(order.index(n) for n in call["sections"])
        bench_argv = call["command"].split("python3 -m rollout.benchmarks.cli ")[1].split()
        args = parser.parse_args([a.replace("$OUT", "/out") for a in bench_argv])
        assert args.only == call["sections"] and args.budget_s == call["budget_s"] < call["timeout_s"]
        assert args.workload == "nano" and (args.merge == []) == (number == 0)
        assert call["command"].count("--target /tmp/site .whl/*.whl") == 1 and ".whl" in call["carry"]
    assert ".gpu-report" in calls[1]["carry"] and "gpu_report.json" in calls[1]["before"]
    # Every wheel the image lacks is fetched, xgrammar's pydantic with its own three among them.
    download = plan["prepare"][1]
    for wheel in ("pyzmq", "trl", "datasets", "xgrammar", "pydantic", "pydantic-core", "annotated-types"):
        assert any(w.startswith(f"{wheel}==") for w in WHEELS) and f" {wheel}==" in download
    # The rehearsal runs the first call's report command, on cpu-small, under a Python 3.12 with the image's versions.
    rehearsal = plan["rehearsal"]
    assert rehearsal[0].startswith("python3.12 -m venv")
    assert all(f"{package}==" in rehearsal[1] for package in ("torch", "transformers", "triton", "numpy"))
    first = calls[0]["command"].split("python3 -m rollout.benchmarks.cli ")[1]
    assert rehearsal[-1].startswith("(export OUT=") and rehearsal[-1].endswith(f"{first} --workload cpu-small)")


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


def test_merge_refuses_what_is_not_a_report(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit):
        parser, args = _parse(
            ["gpu-report", "--merge", str(tmp_path / "bad.json"), "--skip", "gpu-tests", "kernel-tests"]
        )
        gpu_report.main(args, parser)
    assert "not an earlier call's gpu_report.json" in capsys.readouterr().err


def test_a_section_cut_short_keeps_the_systems_it_finished_and_ratios_cross_sections(tmp_path):
    """The headline's sections are separate processes: a throughput section killed at its limit after its rollout
    system finished keeps that system's line (what `isolated.run_system` printed), and each baseline's ratio is
    taken against it; a baseline cut short at its own deadline gets its rate and no verdict on the ratio."""
    rollout = {"system": "rollout", "workload": "nano", "tokens_per_s": 20000.0, "status": "ok"}
    details = {"system": "rollout", "status": "ok", "decode_roofline_fraction": 0.6}
    hang = (
        f"import json, time; print(json.dumps({{**{rollout!r}, 'measured': 'throughput'}}), flush=True); "
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
    markdown = (out / "gpu_report.md").read_text()
    assert "| baseline-generate | transformers_generate tokens/s | 444 (CUT SHORT after 90.0 s: 100 of 256" in markdown
    assert "| baseline-generate | rollout vs transformers_generate | 45.00x over what the baseline finished" in markdown
    assert "| logprob \\|rollout - teacher-forced\\| mean, default | not measured |" in markdown  # one cell
