"""The figures of `rollout-bench gpu-report`: a section's result, a goal, a row of the table, and the rows of each
section but throughput's (`report_throughput.py`); `report_table.py` assembles the table. Pure functions over the
sections' results, so the table is tested on CPU with real benchmark summaries."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from rollout.benchmarks.harness.section_run import SectionResult


@dataclass(frozen=True)
class Goal:
    """A target a figure should reach, e.g. `Goal(">=", 5.0, "x")`."""

    comparison: str  # ">=" or "<="
    target: float
    unit: str = ""

    def met(self, value: float) -> bool:
        """Whether `value` reaches the target."""
        return {">=": operator.ge, "<=": operator.le}[self.comparison](value, self.target)

    def __str__(self) -> str:
        return f"{self.comparison} {self.target:g}{self.unit}"


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    section: str
    figure: str
    value: float | str | None  # None: not measured (its section failed or did not produce it)
    text: str  # the value as shown
    goal: Goal | None = None

    @property
    def verdict(self) -> str:
        if self.goal is None:
            return ""
        if not isinstance(self.value, int | float):
            return f"{self.goal}: not measured"
        return f"{self.goal}: {'met' if self.goal.met(self.value) else 'MISSED'}"


def get_path(data: Any, *path: str) -> Any:
    """data[path[0]][path[1]]..., or None where a key is missing or a level is not a dict."""
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def as_mapping(value: Any) -> dict:
    """`value` when it is a dict, else an empty one (summaries are read as they come, odd shapes included)."""
    return value if isinstance(value, dict) else {}


def number_row(section: str, figure: str, value: Any, spec: str, goal: Goal | None = None, unit: str = "") -> Row:
    """A row for a figure: `value` formatted with `spec` and `unit`, or "not measured" when it is not a number."""
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:  # value != value: NaN
        return Row(section, figure, None, "not measured", goal)
    return Row(section, figure, value, f"{value:{spec}}{unit}", goal)


def tests_rows(result: SectionResult) -> list[Row]:
    """A test section's counts, against no failure; a run cut short (its time limit, a crash) says where. A run cut
    short or in which no test passed (all skipped) gets no verdict unless a test failed: it checked nothing else."""
    counts = result.data
    if "tests" not in counts:
        return [Row(result.name, result.title, None, "did not run", None)]
    text = (
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
    )
    failures = counts["failed"] + counts["errors"]
    cut = as_mapping(counts.get("cut"))
    if cut:
        text += f" (CUT {cut.get('text')})"
    value = None if (cut or not counts["passed"]) and not failures else failures
    return [Row(result.name, result.title, value, text, Goal("<=", 0, " failures"))]


def grpo_rows(result: SectionResult) -> list[Row]:
    """grpo: groups' tokens/s against transformers' generate_batch, and the prompt compute sharing saves."""
    data, name = result.data, result.name
    computed, unshared = get_path(data, "prompt_tokens_computed"), get_path(data, "prompt_tokens_without_sharing")
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (computed, unshared))
    sharing = unshared / computed if numbers and computed else None
    return [
        number_row(name, "rollout tokens/s (n=8 groups, sampled)", get_path(data, "rollout", "tokens_per_s"), ",.0f"),
        number_row(
            name,
            "transformers generate_batch tokens/s",
            get_path(data, "transformers_generate_batch", "tokens_per_s"),
            ",.0f",
        ),
        number_row(
            name,
            "rollout vs transformers generate_batch",
            get_path(data, "speedup_vs_transformers_generate_batch"),
            ".2f",
            unit="x",
        ),
        number_row(name, f"prompt tokens computed (of {unshared} without sharing)", computed, ",.0f"),
        number_row(name, "prompt compute saved by sharing", sharing, ".1f", unit="x"),
    ]


# `batch_invariant=True`'s price in a colocated GRPO step on a GPU (issue 51's goal: at most 25% slower).
INVARIANT_STEP_PRICE_GOAL = Goal("<=", 1.25, "x")


def grpo_step_rows(result: SectionResult) -> list[Row]:
    """grpo-step: each system's step split, and TRL's paths against colocated rollout."""
    data, name = result.data, result.name
    rows = []
    for system in ("rollout_colocate", "rollout_server", "trl_generate", "trl_generate_batch"):
        for part in ("step", "generation", "weight_sync"):
            value = get_path(data, "results", system, f"{part}_s")
            rows.append(number_row(name, f"{system}: {part.replace('_', ' ')} s", value, ".3f", unit=" s"))
    colocated = get_path(data, "results", "rollout_colocate", "generation_s")
    colocated_step = get_path(data, "results", "rollout_colocate", "step_s")
    for system, goal in (("trl_generate", 3.0), ("trl_generate_batch", 2.0)):
        theirs = get_path(data, "results", system, "generation_s")
        ratio = theirs / colocated if positive(theirs, colocated) else None
        rows.append(number_row(name, f"generation: {system} / colocated", ratio, ".2f", Goal(">=", goal, "x"), "x"))
        theirs = get_path(data, "results", system, "step_s")
        ratio = theirs / colocated_step if positive(theirs, colocated_step) else None
        rows.append(number_row(name, f"whole step: {system} / colocated", ratio, ".2f", Goal(">=", 1.0, "x"), "x"))
    return rows


def grpo_step_nano_rows(result: SectionResult) -> list[Row]:
    """grpo-step-nano: colocated steps at the Qwen3-0.6B shape, peak memory, what sleep() frees; then the same steps
    with `batch_invariant=True` and their price (its step's seconds over the plain one's; the goal on a GPU)."""
    data, name = result.data, result.name
    rows = [
        number_row(
            name,
            f"{system}: {part.replace('_', ' ')} s",
            get_path(data, "results", system, f"{part}_s"),
            ".3f",
            unit=" s",
        )
        for system in ("rollout_colocate", "rollout_colocate_invariant")
        for part in ("step", "generation", "training")
    ]
    plain = get_path(data, "results", "rollout_colocate", "step_s")
    invariant = get_path(data, "results", "rollout_colocate_invariant", "step_s")
    price = invariant / plain if positive(plain, invariant) else None
    goal = INVARIANT_STEP_PRICE_GOAL if get_path(data, "device") == "cuda" else None
    rows.append(number_row(name, "batch_invariant step price (invariant / plain step s)", price, ".2f", goal, "x"))
    rows += [
        number_row(
            name,
            "rollout_colocate: peak memory",
            get_path(data, "results", "rollout_colocate", "peak_memory_gib"),
            ".2f",
            unit=" GiB",
        ),
        number_row(
            name,
            "rollout_colocate: memory each sleep() frees",
            get_path(data, "results", "rollout_colocate", "sleep_frees_gib"),
            ".2f",
            unit=" GiB",
        ),
    ]
    return rows


def positive(*values: Any) -> bool:
    """Whether every value is a number above 0 (a ratio's terms)."""
    return all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in values)


def weights_rows(result: SectionResult) -> list[Row]:
    """weights: each transport's GB/s, push time and commit pause."""
    data, name = result.data, result.name
    size = get_path(data, "bytes")
    what = f"{size / 1e9:.2f} GB {get_path(data, 'dtype')}" if isinstance(size, int | float) else "state dict"
    rows = []
    # The goal is for the Qwen3-0.6B-sized bf16 push (1.2 GB) into a GPU worker.
    goal = Goal("<=", 0.5, " s") if isinstance(size, int | float) and 1.1e9 <= size <= 1.3e9 else None
    for transport in as_mapping(get_path(data, "results")) or {"frames": {}, "shm": {}}:
        row = as_mapping(get_path(data, "results", transport))
        rows += [
            number_row(name, f"{transport}: {what} pushed", row.get("gb_per_s"), ".2f", unit=" GB/s"),
            number_row(name, f"{transport}: push time", _push_seconds(size, row.get("gb_per_s")), ".2f", goal, " s"),
            number_row(name, f"{transport}: commit pause", row.get("pause_ms"), ".1f", unit=" ms"),
            number_row(name, f"{transport}: pause beyond the copy", row.get("pause_beyond_copy_ms"), ".2f", unit=" ms"),
        ]
    return rows


def structured_rows(result: SectionResult) -> list[Row]:
    """structured: a grammar's exposed host time, compile times, throughput constrained vs not."""
    data, name = result.data, result.name
    host = as_mapping(get_path(data, "host_time_ms"))
    most = max((key for key in host if key.isdigit()), key=int, default="256")  # the most rows measured
    widest = as_mapping(host.get(most))
    exposed = as_mapping(widest.get("exposed_ms"))
    goal = Goal("<=", 1.0, " ms") if most == "256" else None  # the goal is for 256 rows
    rows = [
        number_row(name, f"grammar: exposed host time, {most} rows", exposed.get("json"), ".2f", goal, " ms"),
        number_row(
            name, f"grammar: mask fill, {most} rows", get_path(widest, "json", "grammar_fill"), ".2f", unit=" ms"
        ),
        number_row(
            name, "JSON schema compile, cold", get_path(data, "compile", "json_schema_cold_ms"), ".1f", unit=" ms"
        ),
        number_row(
            name, "JSON schema compile, cached", get_path(data, "compile", "json_schema_cached_ms"), ".3f", unit=" ms"
        ),
    ]
    for system in ("rollout", "rollout_json"):
        tokens = get_path(data, "throughput", "results", system, "tokens_per_s")
        rows.append(number_row(name, f"{system} tokens/s", tokens, ",.0f"))
    return rows


def speculative_rows(result: SectionResult) -> list[Row]:
    """speculative: the long tail without and with drafts (medians over the repeats), the last sample's speed-up."""
    data, name = result.data, result.name
    medians = as_mapping(get_path(data, "medians"))
    rows = []
    for figure, label, spec, unit in (
        ("tail_forwards_per_token", "tail forwards per generated token", ".3f", ""),
        ("tail_ms_per_token", "tail time per generated token", ".3f", " ms"),
        ("tail_plain_step_ms", "tail plain step", ".3f", " ms"),
        ("tail_drafted_step_ms", "tail drafted step", ".3f", " ms"),
        ("drafted_wait_ms", "drafted step, waiting for the device (the rest: host work not overlapped)", ".3f", " ms"),
        ("tokens_per_s", "tokens/s", ",.0f", ""),
        ("last_finish_s", "the round's last sample", ".2f", " s"),
    ):
        drafted_only = figure in ("tail_drafted_step_ms", "drafted_wait_ms")  # none without drafts
        for side in ("with",) if drafted_only else ("without", "with"):
            rows.append(number_row(name, f"{label}, {side} drafts", get_path(medians, figure, side), spec, unit=unit))
    before, after = get_path(medians, "last_finish_s", "without"), get_path(medians, "last_finish_s", "with")
    sooner = before / after if positive(before, after) else None
    rows.append(number_row(name, "the round's last sample, sooner by", sooner, ".2f", Goal(">=", 1.5, "x"), "x"))
    proposed, accepted = get_path(medians, "draft_tokens", "with"), get_path(medians, "accepted_draft_tokens", "with")
    rows.append(number_row(name, f"draft tokens accepted (of {proposed})", accepted, ",.0f"))
    lost = get_path(medians, "overlap_lost_steps", "with")
    rows.append(number_row(name, "steps not overlapped (host work after the step before), with drafts", lost, ",.0f"))
    return rows


def _push_seconds(size: Any, gb_per_s: Any) -> float | None:
    return size / 1e9 / gb_per_s if positive(size, gb_per_s) else None
