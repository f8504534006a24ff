"""rollout-bench --plot: each subcommand's summary, built by its own code (the expensive measurement faked in-process),
drawn as a small PNG; a missing matplotlib or an unusable path is refused in one line before anything runs."""

from __future__ import annotations

import inspect
import itertools
import json
import struct
import sys
from pathlib import Path

import pytest

from rollout.benchmarks import cli, plots
from rollout.benchmarks.grpo import grpo_step, long_tail, step_system
from rollout.benchmarks.harness import isolated
from rollout.benchmarks.throughput import systems, throughput

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_PNG_BYTES = 80 * 1024
# The long-tail CLI at a shape that runs in well under a second (the stub model), tight enough to preempt.
LONG_TAIL_FLAGS = ["--num-prompts", "4", "--n", "2", "--median-tokens", "16", "--max-tokens", "64"]
LONG_TAIL_FLAGS += ["--prompt-tokens", "8", "16", "--cache-fraction", "0.3"]
# One timed GRPO step as step_system.run_one returns it (its keys are checked against run_one's source below).
GRPO_STEP_ROW = dict(step_s=0.26, generation_s=0.11, weight_sync_s=0.0, training_s=0.15, peak_memory_gib=0.64)
GRPO_STEP_ROW.update(steps=5, tokens_per_s=900.0)


def assert_small_png(path: Path) -> None:
    """A PNG of the figure's 700 x 400 pixels (7 x 4 in at 100 dpi), under MAX_PNG_BYTES."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (700, 400)
    assert len(data) < MAX_PNG_BYTES


@pytest.fixture
def throughput_summary(monkeypatch, capsys) -> dict:
    """`throughput.run`'s summary through its real code and `systems.measure_system`'s, each system's generation
    faked (three runs of different lengths) and run in this process as `isolated.run_system` would return it; the
    last system timed out."""
    runs_s = itertools.cycle([2.0, 2.5, 1.5])

    def generate(model, prompts, max_new, workload, deadline=None):  # far off: transformers' is not cut short
        return next(runs_s), [[0] * n for n in max_new]

    def run_here(benchmark, system, options, timeout_s):
        if system == "transformers_generate":
            return {"system": system, "status": "timeout", "seconds": timeout_s, "error": "past its time limit"}
        return {**isolated.measure_here(benchmark, system, options), "status": "ok"}

    monkeypatch.setattr(systems, "make_workload", lambda workload, seed: (None, [[1, 2]] * 4, [8, 16, 4, 12]))
    monkeypatch.setattr(systems, "release_cached_engine", lambda model: None)
    for name in ("rollout", "transformers_generate_batch"):
        monkeypatch.setitem(systems.SYSTEMS, name, generate)
    monkeypatch.setattr(throughput, "run_system", run_here)
    names = ["rollout", "transformers_generate_batch", "transformers_generate"]
    summary = throughput.run("cpu-small", names, repeats=3, warmup=False)
    capsys.readouterr()
    return json.loads(json.dumps(summary))  # as printed


@pytest.fixture
def grpo_step_summary(monkeypatch, capsys) -> dict:
    """`grpo_step.run`'s summary through its real code, `run_one` (a real GRPO training) replaced by its result's
    shape; the last system failed."""

    def run_here(benchmark, system, options, timeout_s):
        if system == "trl_generate_batch":
            return {"system": system, "status": "failed", "seconds": 1.0, "error": "exit code 1"}
        return {"system": system, "status": "ok", **GRPO_STEP_ROW}

    monkeypatch.setattr(isolated, "run_system", run_here)
    summary = grpo_step.run(device="cpu", steps=5)
    capsys.readouterr()
    return json.loads(json.dumps(summary))


def test_the_keys_plotted_are_those_the_benchmarks_produce(throughput_summary, grpo_step_summary):
    rollout = throughput_summary["results"]["rollout"]
    assert rollout["runs_s"] == [2.0, 2.5, 1.5] and rollout["tokens_per_s"] == 40 / 2.0  # the median run
    assert (
        throughput_summary["device"] == "cpu"
        and throughput_summary["results"]["transformers_generate"]["status"] == "timeout"
    )
    assert set(grpo_step_summary["results"]) == set(grpo_step.SYSTEMS)
    assert "error" in grpo_step_summary["results"]["trl_generate_batch"]
    source = inspect.getsource(step_system._run_in)  # the real row (run_one's) has every key of the fake one
    assert all(f'"{key}"' in source for key in GRPO_STEP_ROW)
    assert {key for key, _, _ in plots.STEP_PARTS} | {"step_s"} <= set(GRPO_STEP_ROW)


def test_throughput_plot(throughput_summary, tmp_path):
    assert_small_png(plots.plot_throughput(throughput_summary, tmp_path / "throughput.png", date="2026-11-26"))


def test_grpo_step_plot(grpo_step_summary, tmp_path):
    assert_small_png(plots.plot_grpo_step(grpo_step_summary, tmp_path / "grpo-step.png"))


def test_long_tail_plot_through_the_cli(tmp_path, capsys):
    """The whole path: flags, the real (stubbed-model) run, the JSON line still last on stdout, then the PNG."""
    path = tmp_path / "long-tail.png"
    cli.main(["long-tail", *LONG_TAIL_FLAGS, "--plot", str(path)])
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["benchmark"] == "long-tail" and summary["finished"]
    assert_small_png(path)
    assert f"plot: {path}" in err


@pytest.mark.parametrize("command", ["throughput", "grpo-step"])
def test_cli_draws_what_the_subcommand_returned(command, throughput_summary, grpo_step_summary, monkeypatch, tmp_path):
    summary = throughput_summary if command == "throughput" else grpo_step_summary
    module = throughput if command == "throughput" else grpo_step
    monkeypatch.setattr(module, "run", lambda *args, **kwargs: summary)
    path = tmp_path / "plot.png"
    cli.main([command, "--plot", str(path)])
    assert_small_png(path)


def refuse_to_run(*args, **kwargs):
    raise AssertionError("the benchmark ran although --plot was refused")


def test_missing_matplotlib_is_one_line_before_the_run(monkeypatch, tmp_path, capsys):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(long_tail, "run", refuse_to_run)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["long-tail", "--plot", str(tmp_path / "long-tail.png")])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-2]  # the last line points at --help
        .endswith("--plot needs matplotlib, which is not installed: pip install 'rollout[docs]'")
    )


@pytest.mark.parametrize(
    "where, message",
    [
        ("missing/plot.png", "does not exist"),
        ("a-file/plot.png", "is not a folder"),  # its "folder" is a regular file
        ("a-folder", "ending in .png"),
        ("a-folder.png", "is a folder"),
        ("plot.svg", "ending in .png"),
    ],
)
def test_unusable_plot_path_is_refused_before_the_run(where, message, monkeypatch, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-folder.png").mkdir()
    monkeypatch.setattr(throughput, "run", refuse_to_run)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["throughput", "--plot", str(tmp_path / where)])
    assert exit_.value.code == 2 and message in capsys.readouterr().err.splitlines()[-2]  # [-1]: the --help hint


def test_unwritable_folder_is_refused_before_the_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(plots.os, "access", lambda path, mode: False)  # as root every folder is writable
    monkeypatch.setattr(grpo_step, "run", refuse_to_run)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["grpo-step", "--plot", str(tmp_path / "grpo-step.png")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()[-2]  # the last line points at --help
    assert err.endswith(f"--plot {tmp_path / 'grpo-step.png'}: not writable")


def test_routing_replay_has_no_plot(capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["grpo-step", "--routing-replay", "--plot", str(tmp_path / "plot.png")])
    assert "not with --routing-replay" in capsys.readouterr().err


def test_a_plot_that_fails_after_the_run_keeps_the_summary(monkeypatch, tmp_path, capsys):
    """The benchmark's JSON line comes first; a plot that cannot be drawn then is one line and exit status 1."""
    monkeypatch.setattr(long_tail, "run", lambda args: {"benchmark": "long-tail"})  # no key the plot reads
    with pytest.raises(SystemExit) as exit_:
        cli.main(["long-tail", "--plot", str(tmp_path / "long-tail.png")])
    out, err = capsys.readouterr()
    assert exit_.value.code == 1 and json.loads(out.splitlines()[-1]) == {"benchmark": "long-tail"}
    assert "not written (KeyError(" in err and err.splitlines()[-1].endswith("; the summary above is complete")
