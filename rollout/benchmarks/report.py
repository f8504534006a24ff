"""The figures of `rollout-bench gpu-report`: what each section's JSON holds, the issue's goals, and one markdown
table. Pure functions over the sections' results, so the table is tested on CPU with real benchmark summaries."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FENCE = "```"  # markdown code fence around a failed section's output


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


@dataclass
class SectionResult:
    """What one section of the report produced."""

    name: str
    title: str
    status: str  # "ok", "failed", "timeout" or "interrupted"
    seconds: float
    data: dict[str, Any] = field(default_factory=dict)  # a benchmark's JSON summary, or a test section's counts
    error: str | None = None  # why it failed: exit status, failing tests, the end of its output
    # The machine it ran on (environment()): set on every section, so a report merged from several calls (several
    # fresh machines) says which machine each figure comes from.
    machine: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        """Whether the section ran to the end and nothing in it failed."""
        return self.status == "ok"


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


def _get(data: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _mapping(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _number(section: str, figure: str, value: Any, spec: str, goal: Goal | None = None, unit: str = "") -> Row:
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:  # value != value: NaN
        return Row(section, figure, None, "not measured", goal)
    return Row(section, figure, value, f"{value:{spec}}{unit}", goal)


def _tests_rows(result: SectionResult) -> list[Row]:
    counts = result.data
    if "tests" not in counts:
        return [Row(result.name, result.title, None, "did not run", None)]
    text = (
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
    )
    return [Row(result.name, result.title, counts["failed"] + counts["errors"], text, Goal("<=", 0, " failures"))]


# Goals on an H200, nano workload (side by side in one run): rollout's tokens/s, and its ratio to each baseline.
ROLLOUT_TOKENS_PER_S_GOAL = Goal(">=", 15000)
BASELINE_GOALS = {"transformers_generate_batch": Goal(">=", 5.0, "x"), "rollout_sequential": Goal(">=", 1.1, "x")}


def _system_rows(name: str, data: dict, system: str, rollout: Any, nano: bool) -> list[Row]:
    """A system's tokens/s and, beside rollout's (`rollout`: its tokens/s, maybe from another section), the ratio.
    A baseline cut short at its time limit shows its rate over what it finished, and no verdict on the ratio."""
    line = _mapping(_get(data, "results", system))
    goal = ROLLOUT_TOKENS_PER_S_GOAL if system == "rollout" and nano else None
    tokens = _number(name, f"{system} tokens/s", line.get("tokens_per_s"), ",.0f", goal)
    cut = _mapping(line.get("cut_short"))
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
    ratio = rollout / tokens.value if _positive(rollout, tokens.value) else None
    figure = f"rollout vs {system}"
    goal = BASELINE_GOALS.get(system) if nano else None
    if cut and ratio is not None:
        return [tokens, Row(name, figure, None, f"{ratio:.2f}x over what the baseline finished: no verdict", goal)]
    return [tokens, _number(name, figure, ratio, ".2f", goal, "x")]


def _throughput_rows(result: SectionResult, report: dict[str, SectionResult]) -> list[Row]:
    data, name = result.data, result.name
    nano = _workload(data) == "nano"
    rollout = _get(data, "results", "rollout", "tokens_per_s")
    rows = []
    for system in ("rollout", *(s for s in _mapping(_get(data, "results")) if s != "rollout")):
        rows += _system_rows(name, data, system, rollout, nano)
    return rows + _details_rows(name, _mapping(_get(data, "details")))


def _baseline_rows(result: SectionResult, report: dict[str, SectionResult]) -> list[Row]:
    """A baseline's section (or the overlap one): its system against rollout's tokens/s from the throughput
    section."""
    data, name = result.data, result.name
    throughput = report.get("throughput")
    rollout = _get(throughput.data, "results", "rollout", "tokens_per_s") if throughput else None
    nano = _workload(data) == "nano"
    systems = [s for s in _mapping(_get(data, "results")) if s != "rollout"] or [BASELINE_SYSTEMS[name]]
    return [row for system in systems for row in _system_rows(name, data, system, rollout, nano)]


def _workload(data: dict) -> str | None:
    """A throughput summary's workload; a partial one (its section cut short) has it in its systems' lines."""
    lines = _mapping(_get(data, "results")).values()
    return data.get("workload") or next((line.get("workload") for line in lines if isinstance(line, dict)), None)


# Each baseline section's system (its figures are "not measured" when the section produced none).
BASELINE_SYSTEMS = {
    "baseline-generate-batch": "transformers_generate_batch",
    "baseline-generate": "transformers_generate",
    "overlap": "rollout_sequential",
}


def _details_rows(name: str, details: dict) -> list[Row]:
    rows = [
        _number(name, "decode roofline fraction", details.get("decode_roofline_fraction"), ".3f", Goal(">=", 0.5)),
        _number(name, "device copy bandwidth", details.get("device_bandwidth_gb_per_s"), ".0f", unit=" GB/s"),
        _number(name, "median decode step", details.get("median_decode_step_ms"), ".2f", unit=" ms"),
        _number(name, "peak memory", details.get("peak_memory_gib"), ".2f", unit=" GiB"),
        _number(
            name, "engine host time per step, 64 running", _get(details, "host_ms_per_step", "64"), ".3f", unit=" ms"
        ),
        _number(
            name,
            "engine host time per step, 256 running",
            _get(details, "host_ms_per_step", "256"),
            ".3f",
            Goal("<=", 1.0, " ms"),
            " ms",
        ),
        _number(name, "logprob fidelity model's mean entropy", details.get("entropy_nats"), ".2f"),
    ]
    for mode in ("default", "fp32_logits"):
        for stat in ("mean", "p99"):
            floor = _get(details, mode, f"floor_abs_diff_{stat}")
            rows.append(_number(name, f"trainer's own floor (padded vs one sequence) {stat}, {mode}", floor, ".2e"))
            value = _get(details, mode, f"logprob_abs_diff_{stat}")
            goal = Goal("<=", floor) if isinstance(floor, (int, float)) else None
            rows.append(_number(name, f"logprob |rollout - teacher-forced| {stat}, {mode}", value, ".2e", goal))
    return rows


def _previous_rows(result: SectionResult) -> list[Row]:
    data, name = result.data, result.name
    return [
        _number(name, "rollout tokens/s", _get(data, "results", "rollout", "tokens_per_s"), ",.0f"),
        _number(name, "rollout_previous tokens/s", _get(data, "results", "rollout_previous", "tokens_per_s"), ",.0f"),
        _number(name, "current vs previous GPU paths", _get(data, "speedup_vs_rollout_previous"), ".2f", unit="x"),
    ]


def _grpo_rows(result: SectionResult) -> list[Row]:
    data, name = result.data, result.name
    computed, unshared = _get(data, "prompt_tokens_computed"), _get(data, "prompt_tokens_without_sharing")
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (computed, unshared))
    sharing = unshared / computed if numbers and computed else None
    return [
        _number(name, "rollout tokens/s (n=8 groups, sampled)", _get(data, "rollout", "tokens_per_s"), ",.0f"),
        _number(
            name,
            "transformers generate_batch tokens/s",
            _get(data, "transformers_generate_batch", "tokens_per_s"),
            ",.0f",
        ),
        _number(
            name,
            "rollout vs transformers generate_batch",
            _get(data, "speedup_vs_transformers_generate_batch"),
            ".2f",
            unit="x",
        ),
        _number(name, f"prompt tokens computed (of {unshared} without sharing)", computed, ",.0f"),
        _number(name, "prompt compute saved by sharing", sharing, ".1f", unit="x"),
    ]


def _grpo_step_rows(result: SectionResult) -> list[Row]:
    data, name = result.data, result.name
    rows = []
    for system in ("rollout_colocate", "rollout_server", "trl_generate", "trl_generate_batch"):
        for part in ("step", "generation", "weight_sync"):
            value = _get(data, "results", system, f"{part}_s")
            rows.append(_number(name, f"{system}: {part.replace('_', ' ')} s", value, ".3f", unit=" s"))
    colocated = _get(data, "results", "rollout_colocate", "generation_s")
    colocated_step = _get(data, "results", "rollout_colocate", "step_s")
    for system, goal in (("trl_generate", 3.0), ("trl_generate_batch", 2.0)):
        theirs = _get(data, "results", system, "generation_s")
        ratio = theirs / colocated if _positive(theirs, colocated) else None
        rows.append(_number(name, f"generation: {system} / colocated", ratio, ".2f", Goal(">=", goal, "x"), "x"))
        theirs = _get(data, "results", system, "step_s")
        ratio = theirs / colocated_step if _positive(theirs, colocated_step) else None
        rows.append(_number(name, f"whole step: {system} / colocated", ratio, ".2f", Goal(">=", 1.0, "x"), "x"))
    return rows


def _grpo_step_nano_rows(result: SectionResult) -> list[Row]:
    data, name = result.data, result.name
    rows = [
        _number(
            name,
            f"rollout_colocate: {part.replace('_', ' ')} s",
            _get(data, "results", "rollout_colocate", f"{part}_s"),
            ".3f",
            unit=" s",
        )
        for part in ("step", "generation", "training")
    ]
    rows += [
        _number(
            name,
            "rollout_colocate: peak memory",
            _get(data, "results", "rollout_colocate", "peak_memory_gib"),
            ".2f",
            unit=" GiB",
        ),
        _number(
            name,
            "rollout_colocate: memory each sleep() frees",
            _get(data, "results", "rollout_colocate", "sleep_frees_gib"),
            ".2f",
            unit=" GiB",
        ),
    ]
    return rows


def _positive(*values: Any) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in values)


def _weights_rows(result: SectionResult) -> list[Row]:
    data, name = result.data, result.name
    size = _get(data, "bytes")
    what = f"{size / 1e9:.2f} GB {_get(data, 'dtype')}" if isinstance(size, int | float) else "state dict"
    rows = []
    # The goal is for the Qwen3-0.6B-sized bf16 push (1.2 GB) into a GPU worker.
    goal = Goal("<=", 0.5, " s") if isinstance(size, int | float) and 1.1e9 <= size <= 1.3e9 else None
    for transport in _mapping(_get(data, "results")) or {"frames": {}, "shm": {}}:
        row = _mapping(_get(data, "results", transport))
        rows += [
            _number(name, f"{transport}: {what} pushed", row.get("gb_per_s"), ".2f", unit=" GB/s"),
            _number(name, f"{transport}: push time", _push_seconds(size, row.get("gb_per_s")), ".2f", goal, " s"),
            _number(name, f"{transport}: commit pause", row.get("pause_ms"), ".1f", unit=" ms"),
            _number(name, f"{transport}: pause beyond the copy", row.get("pause_beyond_copy_ms"), ".2f", unit=" ms"),
        ]
    return rows


def _structured_rows(result: SectionResult) -> list[Row]:
    data, name = result.data, result.name
    host = _mapping(_get(data, "host_time_ms"))
    most = max((key for key in host if key.isdigit()), key=int, default="256")  # the most rows measured
    widest = _mapping(host.get(most))
    exposed = _mapping(widest.get("exposed_ms"))
    goal = Goal("<=", 1.0, " ms") if most == "256" else None  # the goal is for 256 rows
    rows = [
        _number(name, f"grammar: exposed host time, {most} rows", exposed.get("json"), ".2f", goal, " ms"),
        _number(name, "grammar: exposed, resolved first", exposed.get("json_resolve_first"), ".2f", unit=" ms"),
        _number(name, f"grammar: mask fill, {most} rows", _get(widest, "json", "grammar_fill"), ".2f", unit=" ms"),
        _number(name, "JSON schema compile, cold", _get(data, "compile", "json_schema_cold_ms"), ".1f", unit=" ms"),
        _number(name, "JSON schema compile, cached", _get(data, "compile", "json_schema_cached_ms"), ".3f", unit=" ms"),
    ]
    for system in ("rollout", "rollout_json", "rollout_json_resolve_first"):
        tokens = _get(data, "throughput", "results", system, "tokens_per_s")
        rows.append(_number(name, f"{system} tokens/s", tokens, ",.0f"))
    return rows


def _push_seconds(size: Any, gb_per_s: Any) -> float | None:
    return size / 1e9 / gb_per_s if _positive(size, gb_per_s) else None


def _alone(rows_of: Callable[[SectionResult], list[Row]]) -> Callable[[SectionResult, dict], list[Row]]:
    """Rows that need only their own section's figures."""
    return lambda result, report: rows_of(result)


# Section -> its rows, given its result and the whole report by section (a ratio may take a figure of another).
ROWS: dict[str, Callable[[SectionResult, dict[str, SectionResult]], list[Row]]] = {
    "gpu-tests": _alone(_tests_rows),
    "kernel-tests": _alone(_tests_rows),
    "throughput": _throughput_rows,
    "baseline-generate-batch": _baseline_rows,
    "baseline-generate": _baseline_rows,
    "overlap": _baseline_rows,
    "grpo": _alone(_grpo_rows),
    "grpo-step": _alone(_grpo_step_rows),
    "grpo-step-nano": _alone(_grpo_step_nano_rows),
    "throughput-previous": _alone(_previous_rows),
    "weights": _alone(_weights_rows),
    "structured": _alone(_structured_rows),
}


def rows(results: list[SectionResult]) -> list[Row]:
    """Every row of the table, section by section, in the order the sections ran."""
    table = []
    report = {result.name: result for result in results}
    for result in results:
        try:
            table += ROWS[result.name](result, report)
        except Exception as error:  # noqa: BLE001 - one odd summary must not lose the whole report
            table.append(Row(result.name, "figures", None, f"unreadable summary ({type(error).__name__}: {error})"))
    return table


def render_markdown(environment: dict[str, Any], results: list[SectionResult]) -> str:
    """The report as markdown: the machine, one table of figures with their goals, then what failed."""
    lines = [
        f"# rollout GPU report: {environment.get('gpu')}, {environment.get('date')}",
        "",
        ", ".join(
            f"{key} {environment[key]}"
            for key in ("driver", "cuda", "torch", "transformers", "triton", "python", "commit")
            if environment.get(key)
        ),
        "",
        "| section | figure | value | goal |",
        "| --- | --- | ---: | --- |",
    ]
    lines += [f"| {r.section} | {_cell(r.figure)} | {_cell(r.text)} | {r.verdict} |" for r in rows(results)]
    lines += ["", "| section | status | seconds | machine |", "| --- | --- | ---: | --- |"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.0f} | {_machine(r.machine or environment)} |" for r in results]
    failures = [r for r in results if not r.ok]
    if failures:
        lines += ["", "## Failures", ""]
        for result in failures:
            text = (result.error or "").strip().replace(FENCE, "'" * 3)  # keep the fence closed
            lines += [f"### {result.name} ({result.status})", "", FENCE, text, FENCE, ""]
    return "\n".join(lines).rstrip() + "\n"


def _cell(text: str) -> str:
    """Text for a markdown table cell: a `|` of its own (as in |delta|) would end the cell."""
    return text.replace("|", "\\|")


def _machine(machine: dict[str, Any]) -> str:
    return ", ".join(str(machine[key]) for key in ("gpu", "date", "commit") if machine.get(key))


def goals(results: list[SectionResult]) -> list[dict[str, Any]]:
    """Each goal with its figure, value and whether it was met (None: not measured), for the JSON file."""
    return [
        {
            "section": r.section,
            "figure": r.figure,
            "goal": str(r.goal),
            "value": r.value,
            "met": r.goal.met(r.value) if isinstance(r.value, int | float) else None,
        }
        for r in rows(results)
        if r.goal is not None
    ]
