"""`rollout-bench gpu-report --plan` and the sections it runs, on CPU: every section a valid command (on the GPU's
nano workload and the rehearsal's cpu-small), and a plan that fits the 15-minute GPU window by its own JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.benchmarks import cli
from rollout.benchmarks.gpu_report import report as gpu_report

TESTS_DIR = Path(__file__).parent


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
    assert bench["throughput"].batch_invariant  # rollout_invariant beside rollout: its price on the GPU
    assert bench["grpo"].device == device and not bench["grpo"].no_transformers
    assert bench["grpo-step"].device == device and bench["grpo-step"].systems is None  # all four
    colocated = bench["grpo-step-nano"]
    shape = ("nano", 3) if workload == "nano" else ("tiny", 1)
    assert (colocated.device, colocated.systems, (colocated.model, colocated.steps)) == (
        device,
        ["rollout_colocate", "rollout_colocate_invariant"],  # the plain step first: a cut keeps its figures
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
    speculative = bench["speculative"]  # on a GPU the Qwen3-0.6B architecture; the rehearsal's CPU the tiny model
    model = "nano" if workload == "nano" else "tiny"
    assert (speculative.model, speculative.device, speculative.speculative) == (model, device, "suffix")
    assert (speculative.entropy, speculative.known_lengths, speculative.max_num_seqs) == (0.1, True, 64)


def test_the_plan_fits_the_window_by_its_own_json(capsys):
    """`--plan --json`: one headline call of at most 430 s and one optional follow-up, both with their machine starts
    inside the 900 s window; each command at most 2,000 characters, a valid gpu-report command whose sections run
    in the order the issue gives (the report runs them in `sections()` order, so that order must agree)."""
    from rollout.benchmarks.gpu_report.plan import WHEELS

    with pytest.raises(SystemExit) as stop:
        cli.main(["gpu-report", "--plan", "--json"])
    assert stop.value.code == 0
    plan = json.loads(capsys.readouterr().out)
    calls = plan["calls"]
    assert (plan["device_budget_s"], plan["start_s"], len(calls)) == (900, 90, 2)
    assert sum(call["timeout_s"] + plan["start_s"] for call in calls) <= plan["device_budget_s"]
    assert calls[0]["timeout_s"] <= 430 and not calls[0]["optional"] and calls[1]["optional"]
    assert calls[0]["sections"] == ["throughput", "baseline-generate-batch", "baseline-generate", "grpo-step-nano"]
    assert calls[1]["sections"] == ["gpu-tests", "speculative", "kernel-tests"]
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
    # The rehearsal runs each call's report command, on cpu-small, under a Python 3.12 with the image's versions,
    # the first call's report merged into the second's as on the device.
    rehearsal = plan["rehearsal"]
    assert rehearsal[0].startswith("python3.12 -m venv")
    assert all(f"{package}==" in rehearsal[1] for package in ("torch", "transformers", "triton", "numpy"))
    first, second = (call["command"].split("python3 -m rollout.benchmarks.cli ")[1] for call in calls)
    assert rehearsal[-1].startswith("(export OUT=") and rehearsal[-1].endswith(f"{second} --workload cpu-small)")
    assert f"{first} --workload cpu-small; mkdir -p .gpu-report && cp $OUT/gpu-report/gpu_report.json" in rehearsal[-1]


def test_plan_needs_no_gpu(capsys):
    parser = cli.build_parser()
    args = parser.parse_args(["gpu-report", "--plan"])
    assert gpu_report.main(args, parser) == 0
    text = capsys.readouterr().out
    assert "Call 1: the headline" in text and "Call 2 (optional)" in text and "Rehearse here" in text


def test_only_a_call_with_a_call_after_it_says_its_json_feeds_the_next(capsys):
    """Each call's `after` line says what its files hold: the first call's JSON is what the follow-up's `before`
    copies; the last call has no next call, and its files are the whole report and the tests' outcome logs."""
    from rollout.benchmarks.gpu_report.plan import plan, render_plan

    calls = plan()["calls"]
    assert "next call" in calls[0]["after"] and calls[1]["before"] is not None
    assert "next call" not in calls[-1]["after"] and "whole report" in calls[-1]["after"]
    assert ".outcomes.jsonl" in calls[-1]["after"]
    text = render_plan()
    assert [line.strip() for line in text.splitlines() if "after:" in line] == [f"after: {c['after']}" for c in calls]
