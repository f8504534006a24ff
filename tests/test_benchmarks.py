"""rollout-bench stays runnable: the cpu-small throughput workload on this engine prints a table and a JSON line."""

from __future__ import annotations

import json

from rollout.benchmarks import cli


def test_throughput_benchmark_runs_and_ends_with_json(capsys):
    cli.main(["throughput", "--workload", "cpu-small", "--systems", "rollout", "--repeats", "1", "--details"])
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["benchmark"] == "throughput" and summary["num_prompts"] == 64
    assert summary["results"]["rollout"]["tokens_per_s"] > 0
    assert any(line.startswith("rollout") for line in lines[:-1])  # the table row
    details = summary["details"]
    assert 0 < details["decode_roofline_fraction"] < 1 and details["decode_steps"] > 0
    # fp32 model: the engine's logprobs equal transformers' own teacher-forced ones to float rounding.
    assert details["default"]["logprob_abs_diff_max"] < 1e-4
