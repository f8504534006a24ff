"""`rollout-bench gpu-report` orchestration on CPU: argument handling, the no-GPU stop, the sections being valid
`rollout-bench` / pytest commands, and a report assembled from real subprocesses (a real pytest run with a failing
test, a real `rollout-bench weights` run, a crash and a hang)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rollout.benchmarks import cli
from rollout.benchmarks.gpu_report import report as gpu_report

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
        (["--plan", "--out", "elsewhere"], "leave out --out"),  # the plan's calls name their own folder
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
            "gpu-tests",
            "sample tests",
            (sys.executable, "-m", "pytest", "-q", f"--rootdir={test_file.parent}", str(test_file)),  # ids: its own
            120,
            True,
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
    counts = {"tests": 3, "passed": 1, "failed": 1, "errors": 0, "skipped": 1, "collected": 3}
    failing = [f"{test_file.name}::test_fails: AssertionError: one is not two"]
    assert sections["gpu-tests"]["data"] == {**counts, "failing": failing}
    assert f"failed: {failing[0]}" in sections["gpu-tests"]["error"]
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
        ["gpu_report.md", "gpu_report.json", "gpu-tests.outcomes.jsonl", *(f"{s.name}.log" for s in chosen)]
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
    normal exit, a test section that writes no outcomes (only garbage where they go), a summary of the wrong benchmark or of odd shapes: each section ends promptly
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
            "no outcomes",
            (sys.executable, "-c", "import sys; open(sys.argv[-1].split('=', 1)[1], 'w').write('<test')"),
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
    assert (
        sections["gpu-tests"]["status"] == "failed"
        and "pytest wrote no results (exit status 0)" in sections["gpu-tests"]["error"]
    )
    assert sections["kernel-tests"]["status"] == "failed" and "not a 'throughput'" in sections["kernel-tests"]["error"]
    assert sections["weights"]["status"] == "ok"
    markdown = (out / "gpu_report.md").read_text()
    assert "| weights | frames: state dict pushed | not measured |" in markdown
    assert "\ufffd" in (out / "grpo.log").read_text()  # the bad bytes, replaced, not fatal


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


def test_merge_refuses_what_is_not_a_report(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit):
        parser, args = _parse(
            ["gpu-report", "--merge", str(tmp_path / "bad.json"), "--skip", "gpu-tests", "kernel-tests"]
        )
        gpu_report.main(args, parser)
    assert "not an earlier call's gpu_report.json" in capsys.readouterr().err
