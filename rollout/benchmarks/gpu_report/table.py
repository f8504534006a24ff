"""gpu-report's table: every section's rows (`report.py`, `report_throughput.py`) in the order the sections ran,
rendered as markdown, and the goals with their verdicts for the JSON file."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.benchmarks.gpu_report.figures import (
    Row,
    SectionResult,
    grpo_rows,
    grpo_step_nano_rows,
    grpo_step_rows,
    speculative_rows,
    structured_rows,
    tests_rows,
    weights_rows,
)
from rollout.benchmarks.gpu_report.throughput_rows import baseline_rows, throughput_rows

FENCE = "```"  # markdown code fence around a failed section's output


def _alone(rows_of: Callable[[SectionResult], list[Row]]) -> Callable[[SectionResult, dict], list[Row]]:
    """Rows that need only their own section's figures."""
    return lambda result, report: rows_of(result)


# Section -> its rows, given its result and the whole report by section (a ratio may take a figure of another).
ROWS: dict[str, Callable[[SectionResult, dict[str, SectionResult]], list[Row]]] = {
    "gpu-tests": _alone(tests_rows),
    "kernel-tests": _alone(tests_rows),
    "throughput": throughput_rows,
    "baseline-generate-batch": baseline_rows,
    "baseline-generate": baseline_rows,
    "overlap": baseline_rows,
    "grpo": _alone(grpo_rows),
    "grpo-step": _alone(grpo_step_rows),
    "grpo-step-nano": _alone(grpo_step_nano_rows),
    "weights": _alone(weights_rows),
    "structured": _alone(structured_rows),
    "speculative": _alone(speculative_rows),
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
