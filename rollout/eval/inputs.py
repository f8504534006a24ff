"""What a `rollout-eval` run's flags name, loaded and checked: metric, batch config, device, dataset rows and their
fields, model, tokenizer and tokenized prompts. Each failure is an `EvalError`: one line naming the flag (and the row,
for a row's fault) and saying what to do. The cheap checks come first, the model loads last."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from rollout.cli.batch_config_flags import batch_config_from_pairs
from rollout.cli.hub import first_line
from rollout.config import ContinuousBatchingConfig, FieldError
from rollout.eval.dataset import DatasetError, check_fields, load_rows
from rollout.eval.errors import EvalError
from rollout.eval.metrics import Metric, MetricError, load_metric
from rollout.eval.run import PromptError, tokenize_prompts
from rollout.presets.models import MODEL_DTYPES
from rollout.presets.names import is_preset
from rollout.service.launch.loading import (
    EmptyTokenizer,
    holds_no_tokenizer_files,
    load_model,
    load_tokenizer,
    torch_device,
)


@dataclass
class EvalInputs:
    """A run's inputs, loaded and checked.

    Attributes:
        metric: the metric (None without --answer-field).
        batch_config: the engine's settings.
        model: the model, on its device, in its dtype.
        tokenizer: its tokenizer.
        prompts: each row's prompt as the dataset holds it.
        prompt_ids: each prompt tokenized (through the chat template with --chat).
        answers: each row's reference answer (None without --answer-field).
    """

    metric: Metric | None
    batch_config: ContinuousBatchingConfig
    model: torch.nn.Module
    tokenizer: Any
    prompts: list[Any]
    prompt_ids: list[list[int]]
    answers: list[Any] | None


def load_inputs(args: argparse.Namespace) -> EvalInputs:
    """Load and check what the flags name.

    Args:
        args: rollout-eval's parsed flags, already checked by `cli.check_flags`.
    Raises:
        EvalError: a metric, batch config, device, dataset, field, answer, model, tokenizer or prompt the user must fix.
    """
    if args.seed is not None and any(pair.partition("=")[0].strip() == "seed" for pair in args.batch_config):
        raise EvalError("--seed and --batch-config seed=... both set the run's seed: pass one")
    try:
        metric = load_metric(args.metric or "exact_match") if args.answer_field is not None else None
        config = batch_config_from_pairs(args.batch_config, **({} if args.seed is None else dict(seed=args.seed)))
        device_spec = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch_device(device_spec, f"--device {device_spec}")
        rows = load_rows(args.dataset, args.split, args.num_samples, args.max_line_chars)
        # a slice's rows are counted from its first, and hold the fields its rows hold: named as the split's
        rows_of = args.dataset if args.split is None else f"{args.dataset} --split {args.split}"
        check_fields(rows, rows_of, prompt_field=args.prompt_field, answer_field=args.answer_field)
    except FieldError as error:
        raise EvalError(f"--batch-config {error}") from None
    except (MetricError, DatasetError, ValueError) as error:  # each names its flag (torch_device's and the hub's too)
        raise EvalError(str(error)) from None
    answers = None
    if args.answer_field is not None:
        answers = [row[args.answer_field] for row in rows]
        _check_answers(answers, args.answer_field)
    model, tokenizer = _load(args, device)
    if args.chat and not getattr(tokenizer, "chat_template", None):
        raise EvalError(
            f"--chat: the tokenizer of {args.model} has no chat template; drop --chat to feed each prompt as plain "
            "text, or use a chat (instruct) model's tokenizer"
        )
    prompts = [row[args.prompt_field] for row in rows]
    try:
        prompt_ids = tokenize_prompts(tokenizer, prompts, args.chat, args.prompt_field, args.max_line_chars)
    except PromptError as error:
        raise EvalError(str(error)) from None
    return EvalInputs(metric, config, model, tokenizer, prompts, prompt_ids, answers)


def _check_answers(answers: list[Any], field: str) -> None:
    """Every row has a reference answer, and one a metric can read as text (a number or a string)."""
    for index, answer in enumerate(answers):
        if answer is None or answer == "" or _is_nan(answer):
            what = " (NaN, a missing value)" if _is_nan(answer) else ""
            raise EvalError(
                f"--answer-field {field}: row {index} has no answer{what}; fill it in or leave the row out (a missing "
                'answer would be scored against an empty string, or "nan")'
            )
        if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
            raise EvalError(
                f"--answer-field {field}: row {index} holds a {type(answer).__name__}, not text or a number; a metric "
                "compares a completion with one answer text (a module:function metric can parse its own format)"
            )


def _is_nan(value: Any) -> bool:
    """Whether a value is a float NaN: how pandas writes a missing number (a JSON `NaN` from `json.dumps` of its rows,
    a Parquet float column written without nulls)."""
    return isinstance(value, float) and math.isnan(value)


def _load(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The model on its device and its tokenizer, or an EvalError naming the flag."""
    try:
        model = load_model(args.model, MODEL_DTYPES[args.dtype], device)  # refuses a checkpoint lacking weights
    except (ValueError, OSError) as error:  # HubUnreachable and a missing path name --model themselves
        message = first_line(error)
        raise EvalError(message if message.startswith("--model") else f"--model {args.model}: {message}") from None
    try:  # named explicitly, so that tokenizer files that cannot be read say why (not "no tokenizer files")
        tokenizer, _ = load_tokenizer(args.model, args.model)
    except (ValueError, OSError) as error:
        if isinstance(error, EmptyTokenizer) or holds_no_tokenizer_files(args.model):
            raise EvalError(
                f"--model {args.model}: no tokenizer files were found with it, and rollout-eval reads text prompts; "
                "save the model's tokenizer into its directory (tokenizer.save_pretrained(DIR))"
            ) from None
        raise EvalError(f"--model {args.model}: its tokenizer cannot be loaded ({first_line(error)})") from None
    if tokenizer is None:
        raise EvalError(f"--model {args.model}: it has no tokenizer, and rollout-eval reads text prompts")
    if is_preset(args.model):
        print(f"rollout-eval: --model {args.model} is a built-in random model: its text is gibberish", file=sys.stderr)
    return model, tokenizer
