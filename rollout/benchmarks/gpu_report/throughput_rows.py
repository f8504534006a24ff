"""gpu-report's rows of the throughput sections: rollout's tokens/s and details (decode roofline, fidelity against
the trainer's floor, host time), and each baseline's tokens/s with rollout's ratio to it, taken across sections."""

from __future__ import annotations

from typing import Any

from rollout.benchmarks.gpu_report.figures import Goal, Row, SectionResult, as_mapping, get_path, number_row, positive

# Goals on an H200, nano workload (side by side in one run): rollout's tokens/s, and its ratio to each baseline.
ROLLOUT_TOKENS_PER_S_GOAL = Goal(">=", 15000)
BASELINE_GOALS = {"transformers_generate_batch": Goal(">=", 5.0, "x"), "rollout_sequential": Goal(">=", 1.1, "x")}
# `batch_invariant=True`'s price on a GPU: rollout's tokens/s over rollout_invariant's (SGLang's deterministic mode
# costs 34%).
INVARIANT_PRICE_GOAL = Goal("<=", 1.25, "x")


def _system_rows(name: str, data: dict, system: str, rollout: Any, nano: bool) -> list[Row]:
    """A system's tokens/s and, beside rollout's (`rollout`: its tokens/s, maybe from another section), the ratio.
    A baseline cut short at its time limit shows its rate over what it finished, and no verdict on the ratio."""
    line = as_mapping(get_path(data, "results", system))
    goal = ROLLOUT_TOKENS_PER_S_GOAL if system == "rollout" and nano else None
    tokens = number_row(name, f"{system} tokens/s", line.get("tokens_per_s"), ",.0f", goal)
    cut = as_mapping(line.get("cut_short"))
    if cut and tokens.value is not None:
        tokens = Row(
            name,
            tokens.figure,
            tokens.value,
            f"{tokens.text} (CUT SHORT after {line.get('seconds')} s: {cut.get('finished_requests')} of "
            f"{cut.get('requests')} requests finished, {cut.get('tokens')} of {cut.get('requested_tokens')} tokens)",
        )
    if system == "rollout":
        return [tokens]
    ratio = rollout / tokens.value if positive(rollout, tokens.value) else None
    if system == "rollout_invariant":  # not a baseline: what bit-for-bit log-probs cost
        figure = "batch_invariant price (rollout / rollout_invariant tokens/s)"
        return [tokens, number_row(name, figure, ratio, ".2f", INVARIANT_PRICE_GOAL if nano else None, "x")]
    figure = f"rollout vs {system}"
    goal = BASELINE_GOALS.get(system) if nano else None
    if cut and ratio is not None:
        # generate_batch counts its finished requests only (its rate too low, the ratio an upper bound); generate
        # every row's tokens so far (its rate over the start of a static batch, before rows finish and idle).
        bound = "at most " if system == "transformers_generate_batch" else ""
        text = f"{bound}{ratio:.2f}x over what the baseline finished: no verdict"
        return [tokens, Row(name, figure, None, text, goal)]
    return [tokens, number_row(name, figure, ratio, ".2f", goal, "x")]


def throughput_rows(result: SectionResult, report: dict[str, SectionResult]) -> list[Row]:
    """The throughput section: each system's tokens/s (rollout's against its goal on nano), then the details."""
    data, name = result.data, result.name
    nano = _workload(data) == "nano"
    rollout = get_path(data, "results", "rollout", "tokens_per_s")
    rows = []
    for system in ("rollout", *(s for s in as_mapping(get_path(data, "results")) if s != "rollout")):
        rows += _system_rows(name, data, system, rollout, nano)
    return rows + _details_rows(name, as_mapping(get_path(data, "details")), nano)


def baseline_rows(result: SectionResult, report: dict[str, SectionResult]) -> list[Row]:
    """A baseline's section (or the overlap one): its system against rollout's tokens/s from the throughput
    section."""
    data, name = result.data, result.name
    throughput = report.get("throughput")
    rollout = None
    # rollout's figure from the throughput section, when it measured the same workload on the same machine (a merged
    # report may hold sections of other runs).
    if throughput is not None and _workload(throughput.data) == _workload(data):
        if _gpu(throughput) == _gpu(result):
            rollout = get_path(throughput.data, "results", "rollout", "tokens_per_s")
    nano = _workload(data) == "nano"
    systems = [s for s in as_mapping(get_path(data, "results")) if s != "rollout"] or [BASELINE_SYSTEMS[name]]
    return [row for system in systems for row in _system_rows(name, data, system, rollout, nano)]


def _gpu(result: SectionResult) -> Any:
    """The GPU a section ran on (None when its machine is not recorded)."""
    return (result.machine or {}).get("gpu")


def _workload(data: dict) -> str | None:
    """A throughput summary's workload; a partial one (its section cut short) has it in its systems' lines."""
    lines = as_mapping(get_path(data, "results")).values()
    return data.get("workload") or next((line.get("workload") for line in lines if isinstance(line, dict)), None)


# Each baseline section's system (its figures are "not measured" when the section produced none).
BASELINE_SYSTEMS = {
    "baseline-generate-batch": "transformers_generate_batch",
    "baseline-generate": "transformers_generate",
    "overlap": "rollout_sequential",
}


def _details_rows(name: str, details: dict, nano: bool) -> list[Row]:
    """The details' figures; the GPU's goals (roofline, host time) only on the nano workload, the fidelity ones on
    any (the trainer's floor is measured on the same model)."""
    gpu_goal = (lambda goal: goal) if nano else (lambda goal: None)
    rows = [
        number_row(
            name, "decode roofline fraction", details.get("decode_roofline_fraction"), ".3f", gpu_goal(Goal(">=", 0.5))
        ),
        number_row(name, "device copy bandwidth", details.get("device_bandwidth_gb_per_s"), ".0f", unit=" GB/s"),
        number_row(name, "median decode step", details.get("median_decode_step_ms"), ".2f", unit=" ms"),
        number_row(name, "peak memory", details.get("peak_memory_gib"), ".2f", unit=" GiB"),
        number_row(
            name,
            "engine host time per step, 64 running",
            get_path(details, "host_ms_per_step", "64"),
            ".3f",
            unit=" ms",
        ),
        number_row(
            name,
            "engine host time per step, 256 running",
            get_path(details, "host_ms_per_step", "256"),
            ".3f",
            gpu_goal(Goal("<=", 1.0, " ms")),
            " ms",
        ),
        number_row(name, "of it sampling, 256 running", _sampler_host_ms(details), ".3f", unit=" ms"),
        number_row(
            name, "sampler operators a step", get_path(details, "host_time_ms", "256", "sampling_operators"), ".0f"
        ),
        number_row(name, "logprob fidelity model's mean entropy", details.get("entropy_nats"), ".2f"),
    ]
    for mode in ("default", "fp32_logits"):
        for stat in ("mean", "p99"):
            floor = get_path(details, mode, f"floor_abs_diff_{stat}")
            rows.append(number_row(name, f"trainer's own floor (padded vs one sequence) {stat}, {mode}", floor, ".2e"))
            value = get_path(details, mode, f"logprob_abs_diff_{stat}")
            goal = Goal("<=", floor) if isinstance(floor, (int, float)) else None
            rows.append(number_row(name, f"logprob |rollout - teacher-forced| {stat}, {mode}", value, ".2e", goal))
    return rows


def _sampler_host_ms(details: dict) -> float | None:
    """The sampler's share of the host time at 256 running: its time less its operators' arithmetic, which a CPU
    runs on the host and counts out of "host" too (on a GPU that arithmetic is queued, and 0)."""
    sampling = get_path(details, "host_time_ms", "256", "sampling")
    kernels = get_path(details, "host_time_ms", "256", "sampling_kernels")
    if not isinstance(sampling, (int, float)):
        return None
    return sampling - kernels if isinstance(kernels, (int, float)) else sampling
