"""One `rollout-eval` run from its checked flags: inputs loaded (`inputs.py`), samples generated and scored, their rows
written before anything slower happens, then the comparison with transformers' `generate`, then the summary."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from rollout.config import FieldError
from rollout.eval.compare import PromptAgreement, compare_with_generate
from rollout.eval.errors import EvalError, EvalInterrupted
from rollout.eval.inputs import load_inputs
from rollout.eval.metrics import MetricError
from rollout.eval.run import Generated, PromptError, SamplesFailed, SamplesInterrupted, generate, score_rows
from rollout.eval.summary import format_summary, summarize

# The JSONL row's field order: what a reader looks at first.
# The sampling fields rollout-eval's flags set: an engine error about one names the flag.
FIELD_FLAGS = {
    name: f"--{name.replace('_', '-')}" for name in ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "n")
}
ROW_FIELDS = (
    "prompt_index",
    "sample_index",
    "prompt",
    "completion",
    "answer",
    "correct",
    "finish_reason",
    "error",
    "token_ids",
    "logprobs",
)


def evaluate(
    args: argparse.Namespace, write_rows: Callable[[list[dict[str, Any]]], str | None]
) -> tuple[dict[str, Any], list[str]]:
    """Run the evaluation the flags describe.

    Args:
        args: rollout-eval's parsed flags, already checked by `cli.check_flags`.
        write_rows: called with the JSONL rows once they are generated and scored (or generated, when the metric
            fails), before the comparison with `generate`; returns where they went (None: nowhere).
    Returns:
        (the summary as a JSON-ready dict, the summary's printed lines).
    Raises:
        EvalError: anything the user can fix: a dataset, field, answer, model, tokenizer, device, metric, batch
            config or prompt, or samples the engine failed.
        EvalInterrupted: Ctrl-C while generating (the finished samples' rows are written), while scoring (the rows
            are written, unscored) or during the comparison (the rows are written).
    """
    inputs = load_inputs(args)
    config = _generation_config(args)
    try:
        generated = generate(inputs.model, inputs.tokenizer, inputs.prompt_ids, config, inputs.batch_config, args.n)
    except SamplesFailed as error:  # the samples that did finish are kept, unscored, beside the failed ones
        where = write_rows(_finished(error.rows, inputs.prompts))
        raise EvalError(
            f"{error}{f' (the rows, unscored, failed ones with their error, are in {where})' if where else ''}"
        ) from None
    except SamplesInterrupted as interrupt:  # none finished: an earlier run's rows are not replaced by nothing
        where = write_rows(_finished(interrupt.rows, inputs.prompts)) if interrupt.rows else None
        kept = f"; the {len(interrupt.rows)} of {interrupt.total} samples finished, unscored, are in {where}"
        raise EvalInterrupted(f"interrupted while generating{kept if where else ''}") from None
    except FieldError as error:  # the engine's: named by the flag that set the field, where one did
        raise EvalError(str(error.renamed(FIELD_FLAGS))) from None
    except (PromptError, ValueError) as error:  # PromptError names the row
        raise EvalError(str(error)) from None
    for row in generated.rows:
        row["prompt"] = inputs.prompts[row["prompt_index"]]
    metric_spec = args.metric or "exact_match"
    if inputs.metric is not None:
        try:
            score_rows(generated.rows, inputs.answers, inputs.metric, metric_spec)
        except (MetricError, KeyboardInterrupt) as error:  # a slow metric (a judge, tests run) may meet Ctrl-C
            for row in generated.rows:  # every row with its answer, none with a verdict
                row.pop("correct", None)
                row["answer"] = inputs.answers[row["prompt_index"]]
            where = write_rows([_ordered(row) for row in generated.rows])
            if isinstance(error, KeyboardInterrupt):
                raise EvalInterrupted(
                    f"interrupted while scoring{f'; the rows, unscored, are in {where}' if where else ''}"
                ) from None
            raise EvalError(f"{error}{f' (the rows, unscored, are in {where})' if where else ''}") from None
    where = write_rows([_ordered(row) for row in generated.rows])
    agreements = None
    if args.compare_with_generate:
        try:
            agreements = _compare(args, inputs.model, inputs.tokenizer, generated, config)
        except KeyboardInterrupt:
            raise EvalInterrupted(
                f"interrupted while comparing with generate{f'; the rows are in {where}' if where else ''}"
            ) from None
    summary = summarize(generated, args.n, metric_spec if inputs.metric is not None else None, agreements)
    return summary, format_summary(summary, agreements)


def _generation_config(args: argparse.Namespace) -> Any:
    """The sampling settings as a transformers GenerationConfig: rollout and `generate` merge it with the model's
    own generation config the same way, so both apply the same stop tokens and processors. One sequence each: the
    samples per prompt are --n's, and a model's own num_return_sequences would make `generate` refuse greedy
    decoding (set explicitly, it is not replaced by the model's)."""
    from transformers import GenerationConfig

    if args.temperature == 0:
        return GenerationConfig(do_sample=False, max_new_tokens=args.max_new_tokens, num_return_sequences=1)
    sampling = dict(
        do_sample=True, temperature=args.temperature, max_new_tokens=args.max_new_tokens, num_return_sequences=1
    )
    # Unset, top_p and top_k are the model's generation config's, else transformers' defaults (1.0, 50).
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    if args.top_k is not None:
        sampling["top_k"] = args.top_k
    return GenerationConfig(**sampling)


def _compare(
    args: argparse.Namespace, model: Any, tokenizer: Any, generated: Generated, config: Any
) -> list[PromptAgreement]:
    """transformers' generate on the first K prompts against rollout's first sample of each."""
    count = min(args.compare_with_generate, len(generated.prompt_ids))
    ours = {row["prompt_index"]: row["token_ids"] for row in generated.rows if row["sample_index"] == 0}
    firsts = [ours[i] for i in range(count)]
    return compare_with_generate(model, generated.prompt_ids[:count], firsts, config, tokenizer=tokenizer)


def _finished(rows: list[dict[str, Any]], prompts: list[Any]) -> list[dict[str, Any]]:
    """The rows of an unfinished run, each with its prompt, their fields in order."""
    return [_ordered({**row, "prompt": prompts[row["prompt_index"]]}) for row in rows]


def _ordered(row: dict[str, Any]) -> dict[str, Any]:
    """The row with its fields in `ROW_FIELDS` order (those it has)."""
    return {field: row[field] for field in ROW_FIELDS if field in row}
