"""`rollout-eval` (also `python -m rollout.eval`): evaluate a model on a dataset with continuous batching.

    rollout-eval --model Qwen/Qwen3-0.6B --dataset openai/gsm8k:main --prompt-field question \\
        --answer-field answer --metric numeric --chat --num-samples 200 --output gsm8k.jsonl

Runs `generate_batch` over the dataset's prompts (a progress bar on stderr), writes one JSONL row per sample
(`prompt`, `completion`, `token_ids`, `logprobs`, `finish_reason`, `sample_index`, and `correct` with an answer
field; also `prompt_index` and `answer`), and prints a summary: output tokens/s, mean and p95 output length, finish
reasons, and with an answer field accuracy and (n > 1) pass@k with 95% intervals. `--compare-with-generate K` also
runs transformers' `generate` (greedy, same model and dtype) on the first K prompts and reports token agreement and
where each prompt's completions first differ: the check to run after changing a model's code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from rollout.eval.session import EvalError, evaluate
from rollout.service.presets import MODEL_DTYPES


def build_parser() -> argparse.ArgumentParser:
    """rollout-eval's flags."""
    parser = argparse.ArgumentParser(
        prog="rollout-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", required=True, help="a local Hugging Face model directory or hub id; tiny for the built-in model")
    add(
        "--dataset",
        required=True,
        help="a .jsonl / .json / .csv / .parquet file, or a datasets hub dataset as name or name:config",
    )
    add("--split", default=None, help="the split to read (default: train for a file, test for a hub dataset)")
    add("--prompt-field", default="prompt", help="the field holding each prompt (default: prompt)")
    add("--answer-field", default=None, help="the field holding each reference answer (default: none, no accuracy)")
    add(
        "--chat",
        action="store_true",
        help="render each prompt with the tokenizer's chat template as a user turn (a field holding a list of "
        "messages is rendered as is)",
    )
    add("--num-samples", type=int, default=None, help="evaluate the first N rows only (default: all)")
    add("--n", type=int, default=1, help="samples per prompt (default: 1; pass@k is reported when n > 1)")
    add("--max-new-tokens", type=int, default=256, help="most tokens per sample (default: 256)")
    add("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    add("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1.0, off)")
    add("--seed", type=int, default=None, help="seed of the run's sampling, so a run repeats (default: fresh)")
    add(
        "--metric",
        default=None,
        help="with --answer-field: exact_match (default), numeric (the final number, GSM8K's '#### 42' answers) or "
        "module:function, a function (completion, answer) -> bool",
    )
    add("--output", default=None, help="write one JSONL row per sample here (and the summary to OUTPUT.summary.json)")
    add(
        "--compare-with-generate",
        type=int,
        default=0,
        metavar="K",
        help="also run transformers' generate (greedy) on the first K prompts and report token agreement",
    )
    add("--dtype", choices=list(MODEL_DTYPES), default="auto", help="parameter dtype (default: the checkpoint's)")
    add("--device", default=None, help="torch device, e.g. cuda, cuda:1, cpu (default: cuda when visible, else cpu)")
    add(
        "--batch-config",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="ContinuousBatchingConfig fields, e.g. num_blocks=4096 max_batch_tokens=8192",
    )
    return parser


def check_flags(args: argparse.Namespace) -> None:
    """Flag values and combinations that cannot work, found before anything loads.

    Raises:
        EvalError: naming the flag and what to do.
    """
    positive = dict(n=args.n, max_new_tokens=args.max_new_tokens, num_samples=args.num_samples)
    for name, value in positive.items():
        if value is not None and value < 1:
            raise EvalError(f"--{name.replace('_', '-')} {value}: must be at least 1")
    if args.compare_with_generate < 0:
        raise EvalError(f"--compare-with-generate {args.compare_with_generate}: must be 0 (off) or more")
    if not args.temperature >= 0:
        raise EvalError(f"--temperature {args.temperature}: must be 0 (greedy) or more")
    if not 0 < args.top_p <= 1:
        raise EvalError(f"--top-p {args.top_p}: must be in (0, 1]")
    greedy = args.temperature == 0
    if greedy and args.n > 1:
        raise EvalError(
            f"--n {args.n} with greedy decoding (--temperature 0) gives {args.n} identical samples: pass "
            "--temperature above 0 to sample"
        )
    if greedy and args.top_p < 1:
        raise EvalError(f"--top-p {args.top_p} has no effect with greedy decoding: pass --temperature above 0")
    if args.compare_with_generate and not greedy:
        raise EvalError(
            f"--compare-with-generate compares greedy decoding token by token, which sampling at --temperature "
            f"{args.temperature} cannot match: drop --temperature (greedy) or drop --compare-with-generate"
        )
    if args.metric is not None and args.answer_field is None:
        raise EvalError(f"--metric {args.metric} scores against reference answers: pass --answer-field too")
    if args.output is not None:
        folder = os.path.dirname(os.path.abspath(os.path.expanduser(args.output)))
        if not os.path.isdir(folder):
            raise EvalError(f"--output {args.output}: no such directory {folder}")
        if not os.access(folder, os.W_OK):
            raise EvalError(f"--output {args.output}: {folder} is not writable")


def main(argv: list[str] | None = None) -> int:
    """Run rollout-eval; returns the exit status (0, 2 on a usage error, 130 when interrupted)."""
    args = build_parser().parse_args(argv)
    try:
        check_flags(args)
        summary, lines, rows = evaluate(args)
    except EvalError as error:
        print(f"rollout-eval: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rollout-eval: interrupted", file=sys.stderr)
        return 130
    if args.output is not None:
        _write(args.output, rows, summary)
        lines.append(f"rows: {args.output} ({len(rows)}), summary: {args.output}.summary.json")
    print("\n".join(lines), flush=True)
    return 0


def _write(path: str, rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """The rows as JSONL (non-ASCII text as itself) and the summary as JSON beside them."""
    path = os.path.expanduser(path)
    with open(path, "w", encoding="utf-8") as file:
        for row in rows:
            file.write(json.dumps(row, ensure_ascii=False) + "\n")
    with open(f"{path}.summary.json", "w", encoding="utf-8") as file:
        json.dump(summary, file, indent=2)
