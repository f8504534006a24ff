"""rollout-bench stays runnable: the cpu-small throughput workload on this engine prints a table and a JSON line."""

from __future__ import annotations

import json
import time

from rollout.benchmarks import cli
from rollout.benchmarks.gpu_report.table import rows
from rollout.benchmarks.harness.section_run import SectionResult


def _report_rows(name: str, summary: dict) -> dict:
    """gpu-report's rows for a real summary, by figure."""
    return {row.figure: row for row in rows([SectionResult(name, name, "ok", 1.0, data=summary)])}


def test_throughput_benchmark_runs_and_ends_with_json(capsys):
    """Each system in its own process reports one JSON line (on stderr) as it finishes; the details (their own process) judge
    the logprobs against the trainer's own floor on a model with realistic entropy."""
    quick = ["--num-prompts", "8"]  # the first 8 of cpu-small's 64 requests: the whole path, a third of the time
    cli.main(["throughput", "--workload", "cpu-small", "--systems", "rollout", "--repeats", "1", "--details", *quick])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert [line for line in lines if line.startswith("{")] == [lines[-1]]  # one JSON on stdout: the summary
    assert summary["benchmark"] == "throughput" and summary["num_prompts"] == 8
    rollout = summary["results"]["rollout"]
    assert rollout["status"] == "ok" and rollout["tokens_per_s"] > 0 and rollout["warmup_s"] > 0
    system_lines = [json.loads(line) for line in captured.err.splitlines() if line.startswith('{"system": ')]
    # the system's own line, printed once, on stderr, as soon as it finished (then the details' line)
    assert [(line["system"], line["measured"]) for line in system_lines] == [
        ("rollout", "throughput"),
        ("rollout", "details"),
    ]
    first = system_lines[0]
    assert first["system"] == "rollout" and first["tokens_per_s"] == rollout["tokens_per_s"]
    assert summary["kv_budget_bytes"] == 2304 * 64 * 1024  # cpu-small: 2304 blocks of 64 KiB, for every system
    assert any(line.startswith("rollout") for line in lines[:-1])  # the table row
    details = summary["details"]
    assert details["status"] == "ok" and 0 < details["decode_roofline_fraction"] < 1 and details["decode_steps"] > 0
    assert 1.3 < details["entropy_nats"] < 1.7  # the model's logits were scaled to a trained model's entropy
    for mode in ("default", "fp32_logits"):
        row = details[mode]
        # fp32 model: the engine's logprobs equal transformers' own teacher-forced ones to float rounding.
        assert row["logprob_abs_diff_max"] < 1e-4 and row["floor_abs_diff_p99"] < 1e-4
        within = row["logprob_abs_diff_mean"] <= row["floor_abs_diff_mean"]
        assert row["within_floor"] == (within and row["logprob_abs_diff_p99"] <= row["floor_abs_diff_p99"])
    # gpu-report finds every figure in the real summary (only transformers was not run).
    report = _report_rows("throughput", summary)
    assert report["rollout tokens/s"].value == rollout["tokens_per_s"]
    assert report["decode roofline fraction"].value == details["decode_roofline_fraction"]
    host = details["host_ms_per_step"]
    assert set(host) == {"64", "256"} and 0 < host["64"] and 0 < host["256"]
    for size, figures in details["host_time_ms"].items():  # the step, its sampling kernels taken out, its phases
        assert figures["host"] == host[size] and figures["sampling_kernels"] >= 0
        assert abs(figures["step"] - figures["sampling_kernels"] - figures["host"]) <= 0.002
        assert all(figures[phase] > 0 for phase in ("schedule", "inputs", "sampling", "update"))
    assert report["engine host time per step, 256 running"].value == host["256"]
    assert 0 <= report["of it sampling, 256 running"].value < host["256"]  # the sampler's share of the host's time
    fidelity = report["logprob |rollout - teacher-forced| mean, fp32_logits"]
    floor = details["fp32_logits"]["floor_abs_diff_mean"]
    assert fidelity.value == details["fp32_logits"]["logprob_abs_diff_mean"] and fidelity.goal.target == floor
    assert [f for f, row in report.items() if row.value is None] == ["peak memory"]  # CUDA only


def test_a_baseline_cut_short_reports_what_it_finished():
    """transformers' `generate` stopped at a deadline (its own max_time) keeps each row's tokens so far, a prefix of
    what it returns uncut; measured so, the run is reported cut short with its rate over those tokens, and
    gpu-report gives the ratio against it no verdict. `generate_batch` past its deadline stops and returns its
    finished requests only."""

    from rollout.benchmarks.harness.workloads import WORKLOADS, make_workload
    from rollout.benchmarks.throughput.systems import measure_system, run_transformers_generate

    workload = WORKLOADS["cpu-small"]
    model, prompts, max_new = make_workload(workload)
    prompts, max_new = prompts[:4], max_new[:4]
    _, full = run_transformers_generate(model, prompts, max_new, workload)
    assert [len(tokens) for tokens in full] == max_new
    _, cut = run_transformers_generate(model, prompts, max_new, workload, deadline=time.monotonic())  # 0.1 s left
    assert 0 < sum(map(len, cut)) < sum(max_new)
    assert all(tokens == whole[: len(tokens)] for tokens, whole in zip(cut, full))

    for system in ("transformers_generate", "transformers_generate_batch"):
        result = measure_system(system, "cpu-small", num_prompts=4, deadline=time.monotonic())  # past before the run
        cut_short = result["cut_short"]
        assert cut_short["requests"] == 4 and cut_short["requested_tokens"] == sum(max_new)
        assert cut_short["finished_requests"] < 4 and cut_short["tokens"] < sum(max_new)
        assert result["generated_tokens"] == cut_short["tokens"]  # what it generated, not what it was asked for
        if cut_short["tokens"] == 0:  # stopped before its first token (its seconds may round to 0.000)
            assert result["tokens_per_s"] == 0
        else:
            rate = cut_short["tokens"] / result["seconds"]
            assert abs(result["tokens_per_s"] - rate) < 0.1 + result["tokens_per_s"] / 100
        summary = {"benchmark": "throughput", "workload": "nano", "results": {system: result}}
        report = rows(
            [
                SectionResult(
                    "throughput",
                    "t",
                    "ok",
                    1.0,
                    data={"workload": "nano", "results": {"rollout": {"tokens_per_s": 1e6}}},
                ),
                SectionResult("baseline-generate", "b", "ok", 1.0, data=summary),
            ]
        )
        found = {row.figure: row for row in report if row.section == "baseline-generate"}
        assert "CUT SHORT" in found[f"{system} tokens/s"].text
        ratio = found[f"rollout vs {system}"]  # no verdict either way: over what it finished, or nothing finished
        assert ratio.value is None and ("no verdict" in ratio.text) == (cut_short["tokens"] > 0)


def test_grpo_benchmark_shares_each_groups_prompt(capsys):
    """rollout-bench grpo on CPU: a group of 8 computes its prompt once (up to preemptions that recompute)."""
    cli.main(["grpo", "--device", "cpu", "--no-transformers", "--num-prompts", "4"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["group_size"] == 8 and summary["prompts"] == 4 and summary["generated_tokens"] > 0
    assert summary["prompt_tokens_computed"] * 6 < summary["prompt_tokens_without_sharing"]
    assert summary["rollout"]["status"] == "ok" and summary["rollout"]["tokens_per_s"] > 0
    report = _report_rows("grpo", summary)
    assert report["rollout tokens/s (n=8 groups, sampled)"].value == summary["rollout"]["tokens_per_s"]
    computed = f"prompt tokens computed (of {summary['prompt_tokens_without_sharing']} without sharing)"
    assert report[computed].value == summary["prompt_tokens_computed"]


def test_grpo_step_benchmark_splits_each_step(capsys, monkeypatch, tmp_path):
    """rollout-bench grpo-step on CPU, one timed step each of the rollout systems: each step splits into
    generation + weight sync + training; colocated has nothing to push, server mode pushes every step; gpu-report's
    grpo-step-nano rows read the plain and batch-invariant colocated steps and the invariant one's price. The
    trainers' temporary output directories are gone afterwards."""
    systems = ["rollout_colocate", "rollout_server", "rollout_colocate_invariant"]
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # each system's process makes its temporary files there
    cli.main(["grpo-step", "--device", "cpu", "--steps", "1", "--systems", *systems])
    assert not list(tmp_path.glob("grpo_step_*")), "a trainer's output directory was left behind"
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["benchmark"] == "grpo-step" and summary["device"] == "cpu"
    results = summary["results"]
    assert set(results) == set(systems), results
    for system, row in results.items():
        assert "error" not in row, (system, row)
        parts = row["generation_s"] + row["weight_sync_s"] + row["training_s"]
        assert abs(parts - row["step_s"]) <= 0.002 and row["generation_s"] > 0 and row["training_s"] > 0
        assert row["peak_memory_gib"] > 0 and row["steps"] == 1
        assert any(line.startswith(system) for line in lines[:-1])  # its table row
    # Colocated: nothing to push (a no-op); server: a real push each step (a few ms for the tiny model over shm).
    assert results["rollout_colocate"]["weight_sync_s"] < 0.002
    assert results["rollout_server"]["weight_sync_s"] > results["rollout_colocate"]["weight_sync_s"]
    report = _report_rows("grpo-step", summary)  # gpu-report reads the same summary
    assert report["rollout_colocate: step s"].value == results["rollout_colocate"]["step_s"]
    assert report["rollout_server: weight sync s"].value == results["rollout_server"]["weight_sync_s"]
    assert report["generation: trl_generate / colocated"].value is None  # not run here
    nano = _report_rows("grpo-step-nano", summary)
    invariant = results["rollout_colocate_invariant"]["step_s"]
    assert nano["rollout_colocate_invariant: step s"].value == invariant
    price = nano["batch_invariant step price (invariant / plain step s)"]
    assert price.value == invariant / results["rollout_colocate"]["step_s"]
    assert price.goal is None  # the 1.25x goal is a GPU's


def test_agentic_service_benchmark_measures_both_routings(capsys):
    """`rollout-bench service --agentic` on a small agent: a line per routing as it finishes, then the JSON, whose
    figures come from the completions' cached_prompt_tokens; flags of the other mode are refused by name."""
    import pytest

    for wrong, message in ((["--turns", "3"], "--turns needs --agentic"), (["--agentic", "--path", "http"], "--path")):
        with pytest.raises(SystemExit):
            cli.main(["service", *wrong])
        assert message in capsys.readouterr().err
    cli.main(["service", "--agentic", "--turns", "3", "--episodes", "2", "--workers", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert [line.split()[0] for line in lines[:-1]] == ["with_affinity", "without_affinity"]
    assert (summary["turns"], summary["episodes"], summary["workers"]) == (3, 2, 2)
    for routing in ("with_affinity", "without_affinity"):
        assert len(summary[routing]["per_turn"]) == 2 and summary[routing]["ratio"] > 0
    # with affinity every later turn finds all earlier whole blocks in its worker's cache: at most one partial
    # block (16 tokens) of the 64 a turn appends is computed again
    assert summary["with_affinity"]["ratio"] <= (64 + 16) / 64 and summary["passed"]


def test_structured_benchmark_reports_grammar_host_time_and_compile(capsys):
    """`rollout-bench structured` at a small size: compile cold and cached, host time per mode with the grammar's
    own fill / apply / accept times, the grammar's exposed host time; a bad flag is refused by name."""
    import pytest

    with pytest.raises(SystemExit):
        cli.main(["structured", "--vocab-size", "10"])
    assert "--vocab-size" in capsys.readouterr().err
    cli.main(["structured", "--rows", "4", "--steps", "5", "--vocab-size", "2000", "--repeats", "0"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["benchmark"] == "structured" and summary["vocab_size"] == 2000
    compile_ms = summary["compile"]
    assert compile_ms["json_schema_cached_ms"] < compile_ms["json_schema_cold_ms"]
    figures = summary["host_time_ms"]["4"]
    assert "grammar_fill" not in figures["none"] and figures["json"]["grammar_fill"] > 0
    assert figures["json"]["grammar_accept"] > 0
    assert set(figures["exposed_ms"]) == {"json"} and "throughput" not in summary
    report = _report_rows("structured", summary)  # gpu-report reads the same summary
    assert report["grammar: exposed host time, 4 rows"].value == figures["exposed_ms"]["json"]
    assert report["JSON schema compile, cached"].value == compile_ms["json_schema_cached_ms"]
    assert report["rollout_json tokens/s"].value is None  # the throughput part was skipped


def test_a_time_budget_puts_the_headline_first(monkeypatch):
    """Under --time-budget, rollout's own run gets two thirds of the budget (the details count as half a system and
    then get all that is left), and a baseline is told to stop 15 s before its process would be killed."""
    from rollout.benchmarks.throughput import throughput

    asked = []

    def fake_run_system(benchmark, system, options, timeout_s):
        stop_in = options["deadline"] - time.monotonic() if "deadline" in options else None
        asked.append((benchmark, system, stop_in, timeout_s))
        line = {"system": system, "status": "ok", "tokens_per_s": 1.0, "seconds": 1.0, "warmup_s": 0.0}
        return {**line, "generated_tokens": 1, "decode_roofline_fraction": 0.5, "device_bandwidth_gb_per_s": 1}

    monkeypatch.setattr(throughput, "run_system", fake_run_system)
    monkeypatch.setattr(throughput, "_print_table", lambda summary: None)
    throughput.run("cpu-small", ["rollout"], details=True, time_budget_s=90)
    (_, _, rollout_stop, rollout_limit), (details, _, _, details_limit) = asked
    assert rollout_stop is None and abs(rollout_limit - 60) < 1  # rollout is not cut: a timeout past its limit
    assert details == "details" and abs(details_limit - 90) < 1  # the fake took no time: all of it is left
    asked.clear()
    throughput.run("cpu-small", ["transformers_generate_batch"], time_budget_s=90)
    stop_in, limit = asked[0][2:]
    assert abs(stop_in - (limit - 15)) < 1 and abs(limit - 90) < 1


def test_a_profile_names_where_the_time_went():
    """`device_profile` over torch's own profiler (on a CPU: operators by their own time): twenty 384x384 matmuls
    beside five small additions come first, with their call count; the printed lines name it."""
    import torch

    from rollout.benchmarks.throughput.device_profile import device_profile, format_profile

    a, b = torch.randn(384, 384), torch.randn(8)

    def run() -> None:
        for _ in range(20):
            torch.mm(a, a)
        for _ in range(5):
            torch.add(b, b)

    summary = device_profile(run, "cpu", top=3)
    first = summary["top"][0]
    assert (first["name"], first["calls"]) == ("aten::mm", 20) and first["share"] > 0.5
    assert {"aten::add"} <= {entry["name"] for entry in summary["top"]} and len(summary["top"]) <= 3
    # two clocks (the profiler's, perf_counter): operators run back to back may sum a little past the wall time
    assert 0 < summary["busy_ms"] <= 1.05 * summary["wall_ms"] and summary["busy_fraction"] <= 1
    lines = format_profile("rollout", summary)
    assert lines[0].startswith("rollout profile:") and "aten::mm" in lines[1]


def test_fairness_benchmark_the_express_lane_lets_a_short_request_pass(capsys):
    """`rollout-bench fairness`: beside a group of twice max_num_seqs samples, client B's 4-token request finishes
    within a few steps with the express lane open, and only after the whole group with it closed; each run
    generates every one of A's tokens. Through the CLI with a cap shorter than the group, the closed lane's wait is
    reported as not finished (no figure), the open lane's is not."""
    from rollout.benchmarks.service import fairness

    shape = fairness.Scenario(groups=1, n=8, max_new_tokens=24, max_num_seqs=4, cache_share=2.0, b_after=3)
    summary = fairness.run(("wide-group",), max_steps=200, shapes={"wide-group": shape})
    figures = summary["scenarios"]["wide-group"]
    opened, closed = figures["open"], figures["closed"]
    for line in (opened, closed):
        assert line["finished"] and line["a_tokens"] == shape.n * shape.max_new_tokens, line
        assert line["a_samples"] == shape.n and line["steps"] < 200 and line["a_tokens_per_s"] > 0
    # 8 samples in 4 slots: a step decodes half of them, so the group takes about 2 x 24 steps
    assert closed["a_samples_done_before_b"] == shape.n and closed["b_wait_steps"] >= 2 * shape.max_new_tokens - 6
    assert opened["a_samples_done_before_b"] == 0 and 5 * opened["b_wait_steps"] < closed["b_wait_steps"]
    assert 0 < opened["b_wait_s"] < closed["b_wait_s"]
    capsys.readouterr()

    cli.main(["fairness", "--scenarios", "wide-group", "--max-steps", "15"])  # the default shape: 200 tokens
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert (
        summary["benchmark"] == "fairness"
        and summary["max_steps"] == 15
        and list(summary["scenarios"]) == ["wide-group"]
    )
    opened, closed = summary["scenarios"]["wide-group"]["open"], summary["scenarios"]["wide-group"]["closed"]
    assert opened["finished"] and opened["b_wait_steps"] < 15 - fairness.SCENARIOS["wide-group"].b_after
    assert not closed["finished"] and closed["b_wait_steps"] is None and closed["b_wait_s"] is None
    assert (
        closed["steps"] == 15
        and closed["a_tokens"] > 0
        and closed["b_submitted_step"] == fairness.SCENARIOS["wide-group"].b_after
    )
    assert [line.split()[:2] for line in lines[2:4]] == [["wide-group", "open"], ["wide-group", "closed"]]
    assert "not finished" in lines[3]


def test_agentic_service_benchmark_refuses_a_zero_by_name(capsys):
    """`--workers 0` (or `--turns 0`, `--episodes 0`) ran the default (2 workers, 10 turns, 16 episodes) silently,
    and its JSON reported the default: each is a usage error naming the flag and the value given."""
    import pytest

    for flag, least in (("--turns", 2), ("--episodes", 1), ("--workers", 1)):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["service", "--agentic", flag, "0"])
        assert exit_info.value.code == 2 and f"{flag} must be >= {least}, got 0" in capsys.readouterr().err


def test_fairness_benchmark_refuses_a_bad_flag_by_name(capsys):
    """A cap below one step, or an unknown scenario, is a usage error (exit status 2) naming the flag."""
    import pytest

    for flags, named in ((["--max-steps", "0"], "--max-steps must be >= 1"), (["--scenarios", "wide"], "--scenarios")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["fairness", *flags])
        assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_a_cuda_device_on_a_machine_without_one_is_a_usage_error(capsys):
    """`--device cuda` where torch sees no CUDA device is one line naming the flag (exit status 2), for every
    subcommand that takes --device; it had been each system's traceback, and exit status 0."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    for command in (
        ["grpo"],
        ["grpo-step", "--steps", "1"],
        ["fleet"],
        ["weights"],
        ["long-tail", "--model", "tiny"],
        ["structured"],
    ):
        for device in ("cuda", "cuda:1"):
            if device == "cuda:1" and command[0] not in ("weights",):
                continue  # the others take "cpu" or "cuda" only (argparse's choices)
            with pytest.raises(SystemExit) as exit_info:
                cli.main([*command, "--device", device])
            err = capsys.readouterr().err
            assert exit_info.value.code == 2, (command, err)
            assert f"--device {device}: no CUDA device is available" in err, (command, err)


def test_an_unknown_device_is_refused_by_name_listing_the_forms(capsys):
    """`rollout-bench weights --device tpu` (its --device is free text) ended in torch's traceback, which lists some
    twenty device types rollout does not run on; it is one usage line naming the flag and the accepted forms."""
    import pytest

    for device in ("tpu", "cuda:x"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["weights", "--device", device])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err
        assert f"--device {device}: not a device rollout runs on; give cpu, cuda or cuda:N" in err
