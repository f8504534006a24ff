"""`rollout-eval`'s summary: throughput, output lengths, finish reasons, accuracy and pass@k with 95% intervals, and
the comparison with transformers' `generate`."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rollout.eval.compare import PromptAgreement
from rollout.eval.run import Generated
from rollout.eval.stats import ks_to_report, mean_interval, pass_at_k, percentile, wilson_interval


def summarize(generated: Generated, n: int, metric: str | None, agreements: list[PromptAgreement] | None) -> dict:
    """The run's figures as a JSON-ready dict (what `format_summary` prints).

    Args:
        generated: the run.
        n: samples per prompt.
        metric: the metric's name, None when the dataset had no answer field (no accuracy then).
        agreements: `--compare-with-generate`'s per-prompt results, None when not asked.
    """
    rows = generated.rows
    lengths = [len(row["token_ids"]) for row in rows]
    summary: dict[str, Any] = dict(
        prompts=len(generated.prompt_ids),
        samples=len(rows),
        n=n,
        seconds=generated.seconds,
        warmup_seconds=generated.warmup_seconds,
        output_tokens=generated.output_tokens,
        tokens_per_second=generated.output_tokens / generated.seconds if generated.seconds > 0 else None,
        mean_output_length=sum(lengths) / len(lengths) if lengths else 0.0,
        p95_output_length=percentile(lengths, 95) if lengths else 0.0,
        finish_reasons=dict(Counter(row["finish_reason"] for row in rows).most_common()),
    )
    if metric is not None and rows:
        summary["metric"] = metric
        summary.update(_accuracy(rows, n))
    if agreements is not None:
        summary["compare_with_generate"] = dict(
            prompts=len(agreements),
            identical=sum(a.first_divergence is None for a in agreements),
            near_ties=sum(a.near_tie for a in agreements),
            token_agreement=sum(a.agreement for a in agreements) / len(agreements) if agreements else None,
            per_prompt=[
                dict(
                    prompt_index=a.prompt_index,
                    agreement=a.agreement,
                    first_divergence=a.first_divergence,
                    logit_gap=a.logit_gap,
                    rounding_step=a.rounding_step,
                    near_tie=a.near_tie,
                )
                for a in agreements
            ],
        )
    return summary


def _accuracy(rows: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Accuracy over all samples with its 95% interval (Wilson's over the samples when n == 1; with n > 1 over the
    prompts, a prompt's samples not being independent: `mean_interval`), and pass@k for k in `ks_to_report(n)`."""
    correct = sum(row["correct"] for row in rows)
    figures: dict[str, Any] = dict(correct=correct, accuracy=correct / len(rows))
    if n == 1:
        figures["accuracy_interval"] = list(wilson_interval(correct, len(rows)))
        return figures
    per_prompt = Counter(row["prompt_index"] for row in rows if row["correct"])
    prompts = sorted({row["prompt_index"] for row in rows})
    figures["accuracy_interval"] = list(mean_interval([per_prompt[p] / n for p in prompts]))
    figures["pass_at_k"] = {}
    for k in ks_to_report(n):
        values = [pass_at_k(n, per_prompt[p], k) for p in prompts]
        figures["pass_at_k"][str(k)] = dict(value=sum(values) / len(values), interval=list(mean_interval(values)))
    return figures


def format_summary(summary: dict[str, Any], agreements: list[PromptAgreement] | None) -> list[str]:
    """The summary as the lines `rollout-eval` prints."""
    lines = [
        f"{summary['prompts']} prompts x {summary['n']} = {summary['samples']} samples in "
        f"{summary['seconds']:.2f} s (engine build and warm-up, {summary['warmup_seconds']:.2f} s, not counted)",
        f"throughput: {summary['tokens_per_second'] or 0:,.0f} output tokens/s ({summary['output_tokens']:,} tokens)",
        f"output length: mean {summary['mean_output_length']:.1f}, p95 {summary['p95_output_length']:.1f} tokens",
        "finish reasons: "
        + ", ".join(
            f"{reason} {count} ({count / summary['samples']:.1%})"
            for reason, count in summary["finish_reasons"].items()
        ),
    ]
    if "accuracy" in summary:
        low, high = summary["accuracy_interval"]
        lines.append(
            f"accuracy ({summary['metric']}): {summary['accuracy']:.4f} ({summary['correct']}/{summary['samples']}; "
            f"95% interval {low:.4f}-{high:.4f})"
        )
        for k, figure in summary.get("pass_at_k", {}).items():
            low, high = figure["interval"]
            lines.append(f"pass@{k}: {figure['value']:.4f} (95% interval {low:.4f}-{high:.4f})")
    if agreements is not None:
        compared = summary["compare_with_generate"]
        lines.append(
            f"compare with transformers' generate (greedy, first {compared['prompts']} prompts): "
            f"{compared['identical']}/{compared['prompts']} identical, token agreement "
            f"{(compared['token_agreement'] or 0):.1%}"
            + (f", {compared['near_ties']} diverging at a near tie" if compared["near_ties"] else "")
        )
        lines += [f"  {agreement.describe()}" for agreement in agreements]
    return lines
