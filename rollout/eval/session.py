"""One `rollout-eval` run from its checked flags: load what they name (each failure one line naming its flag), generate,
score, compare with transformers' `generate`, summarize."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from rollout.batch_config_flags import batch_config_from_pairs
from rollout.config import FieldError
from rollout.eval.compare import PromptAgreement, compare_with_generate
from rollout.eval.dataset import DatasetError, check_fields, load_rows
from rollout.eval.metrics import MetricError, load_metric
from rollout.eval.run import PromptError, generate, score_rows, tokenize_prompts
from rollout.eval.summary import format_summary, summarize
from rollout.hub import first_line
from rollout.service.loading import load_model, load_tokenizer, torch_device
from rollout.service.preset_names import is_preset
from rollout.service.presets import MODEL_DTYPES


class EvalError(Exception):
    """What stops a run, as one line for the user (naming the flag, saying what to do)."""


def evaluate(args: argparse.Namespace) -> tuple[dict[str, Any], list[str], list[dict[str, Any]]]:
    """Run the evaluation the flags describe.

    Args:
        args: rollout-eval's parsed flags, already checked by `cli.check_flags`.
    Returns:
        (the summary as a JSON-ready dict, the summary's printed lines, the JSONL rows).
    Raises:
        EvalError: anything the user can fix: a dataset, field, model, tokenizer, device, metric or batch config.
    """
    metric_spec = args.metric or "exact_match"
    try:
        metric = load_metric(metric_spec) if args.answer_field is not None else None
        config = batch_config_from_pairs(args.batch_config, **({} if args.seed is None else dict(seed=args.seed)))
        device_spec = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch_device(device_spec, f"--device {device_spec}")
        dataset = load_rows(args.dataset, args.split, args.num_samples)
        if not dataset:
            raise EvalError(f"--dataset {args.dataset}: the split has no rows")
        check_fields(dataset, args.dataset, prompt_field=args.prompt_field, answer_field=args.answer_field)
    except (MetricError, DatasetError) as error:
        raise EvalError(str(error)) from None
    except FieldError as error:
        raise EvalError(f"--batch-config {error}") from None
    except ValueError as error:  # torch_device's and the hub's messages name their flag
        raise EvalError(str(error)) from None
    if args.seed is not None and any(pair.partition("=")[0].strip() == "seed" for pair in args.batch_config):
        raise EvalError("--seed and --batch-config seed=... both set the run's seed: pass one")
    model, tokenizer = _load(args, device)
    if args.chat and not getattr(tokenizer, "chat_template", None):
        raise EvalError(
            f"--chat: the tokenizer of {args.model} has no chat template; drop --chat to feed each prompt as plain "
            "text, or use a chat (instruct) model's tokenizer"
        )
    prompts = [row[args.prompt_field] for row in dataset]
    try:
        prompt_ids = tokenize_prompts(tokenizer, prompts, args.chat, args.prompt_field)
    except PromptError as error:
        raise EvalError(str(error)) from None
    generation_config = _generation_config(args)
    try:
        generated = generate(model, tokenizer, prompt_ids, generation_config, config, args.n)
    except ValueError as error:  # a prompt longer than the model's context, a cache too small for one: named
        raise EvalError(first_line(error)) from None
    for row in generated.rows:
        row["prompt"] = prompts[row["prompt_index"]]
    if args.answer_field is not None:
        try:
            score_rows(generated.rows, [row[args.answer_field] for row in dataset], metric, metric_spec)
        except MetricError as error:
            raise EvalError(str(error)) from None
    agreements = _compare(args, model, generated, generation_config) if args.compare_with_generate else None
    summary = summarize(generated, args.n, metric_spec if metric is not None else None, agreements)
    return summary, format_summary(summary, agreements), [_ordered(row) for row in generated.rows]


def _load(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The model on its device and its tokenizer, or an EvalError naming the flag."""
    try:
        model = load_model(args.model, MODEL_DTYPES[args.dtype], device)
    except (ValueError, OSError) as error:  # HubUnreachable is a ValueError that names --model itself
        message = first_line(error)
        raise EvalError(message if message.startswith("--model") else f"--model {args.model}: {message}") from None
    try:
        tokenizer, _ = load_tokenizer(args.model, None)
    except (ValueError, OSError) as error:
        raise EvalError(f"--model {args.model}: its tokenizer cannot be loaded ({first_line(error)})") from None
    if tokenizer is None:
        raise EvalError(f"--model {args.model}: has no tokenizer, and rollout-eval reads text prompts")
    if is_preset(args.model):
        print(f"rollout-eval: --model {args.model} is a built-in random model: its text is gibberish", file=sys.stderr)
    return model, tokenizer


def _generation_config(args: argparse.Namespace) -> Any:
    """The sampling settings as a transformers GenerationConfig: rollout and `generate` merge it with the model's
    own generation config the same way, so both apply the same stop tokens and processors."""
    from transformers import GenerationConfig

    if args.temperature == 0:
        return GenerationConfig(do_sample=False, max_new_tokens=args.max_new_tokens)
    return GenerationConfig(
        do_sample=True, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens
    )


def _compare(args: argparse.Namespace, model: torch.nn.Module, generated: Any, config: Any) -> list[PromptAgreement]:
    """transformers' generate on the first K prompts against rollout's first sample of each."""
    count = min(args.compare_with_generate, len(generated.prompt_ids))
    ours = {row["prompt_index"]: row["token_ids"] for row in generated.rows if row["sample_index"] == 0}
    return compare_with_generate(model, generated.prompt_ids[:count], [ours[i] for i in range(count)], config)


# The JSONL row's field order: what a reader looks at first.
ROW_FIELDS = (
    "prompt_index",
    "sample_index",
    "prompt",
    "completion",
    "answer",
    "correct",
    "finish_reason",
    "token_ids",
    "logprobs",
)


def _ordered(row: dict[str, Any]) -> dict[str, Any]:
    """The row with its fields in `ROW_FIELDS` order (those it has)."""
    return {field: row[field] for field in ROW_FIELDS if field in row}
