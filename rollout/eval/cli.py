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
import math
import re
import signal
import sys
from typing import NoReturn

from rollout.cli.interrupts import deferring_sigint, recording_sigint
from rollout.cli.parser import CliParser
from rollout.cli.process_exit import run_console_script
from rollout.config import MIN_TEMPERATURE, MODEL_DTYPE_NAMES
from rollout.eval.errors import EvalError, EvalInterrupted
from rollout.eval.files import DEFAULT_MAX_LINE_CHARS
from rollout.eval.output import check_output, write_rows, write_summary
from rollout.presets.catalog import PRESETS

SAMPLED_TEMPERATURE = 1.0  # --n above 1 without --temperature: samples that differ (pass@k needs them to)


def build_parser() -> CliParser:
    """rollout-eval's flags."""
    parser = CliParser(prog="rollout-eval", description=__doc__)
    parser.add_version_flag()
    add = parser.add_argument
    add(
        "--model",
        required=True,
        help=f"a local Hugging Face model directory or hub id, or a built-in preset: {', '.join(PRESETS)}",
    )
    add(
        "--dataset",
        required=True,
        help="a .jsonl / .json / .csv / .parquet file, a local dataset directory (DIR or DIR:config), or a datasets "
        "hub dataset as name or name:config",
    )
    add(
        "--split",
        default=None,
        help="the split to read, with datasets slicing such as test[:100] (default: train for a file or directory, "
        "test for a hub dataset)",
    )
    add("--prompt-field", default="prompt", help="the field holding each prompt")
    add("--answer-field", default=None, help="the field holding each reference answer (default: none, no accuracy)")
    add(
        "--chat",
        action="store_true",
        help="render each prompt with the tokenizer's chat template as a user turn (a field holding a list of "
        "messages is rendered as is)",
    )
    add("--num-samples", type=int, default=None, help="evaluate the first N rows only (default: all)")
    add(
        "--max-line-chars",
        type=int,
        default=DEFAULT_MAX_LINE_CHARS,
        metavar="N",
        help="the longest line of a JSONL or CSV dataset, and the longest prompt, in characters; a longer one is "
        f"refused at once, naming its line or row (default: {DEFAULT_MAX_LINE_CHARS})",
    )
    add("--n", type=int, default=1, help="samples per prompt (default: 1; pass@k is reported when n > 1)")
    add("--max-new-tokens", type=int, default=256, help="most tokens per sample")
    add(
        "--temperature",
        type=float,
        default=None,
        help=f"sampling temperature; 0 is greedy (default: 0 with --n 1, {SAMPLED_TEMPERATURE} with --n above 1, "
        "whose samples must differ)",
    )
    add(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling threshold; 1 is off (default: the model's generation config, else 1, as transformers' "
        "generate)",
    )
    add(
        "--top-k",
        type=int,
        default=None,
        help="sample from the k likeliest tokens; 0 is off (default: the model's generation config, else 50, as "
        "transformers' generate)",
    )
    add(
        "--seed",
        type=int,
        default=None,
        help="seed of the run's sampling (above --temperature 0), so a run repeats (default: fresh)",
    )
    add(
        "--metric",
        default=None,
        help="with --answer-field: exact_match (default), numeric (the final number, GSM8K's '#### 42' answers) or "
        "module:function, a function (completion, answer) -> bool",
    )
    add(
        "--output",
        default=None,
        help="write one JSONL row per sample here (and the summary to OUTPUT.summary.json; default: none, the summary "
        "is printed only)",
    )
    add(
        "--compare-with-generate",
        type=int,
        default=0,
        metavar="K",
        help="also run transformers' generate (greedy) on the first K prompts and report token agreement",
    )
    add("--dtype", choices=MODEL_DTYPE_NAMES, default="auto", help="parameter dtype (default: auto, the checkpoint's)")
    add("--device", default=None, help="torch device, e.g. cuda, cuda:1, cpu (default: cuda when visible, else cpu)")
    add(
        "--batch-config",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="ContinuousBatchingConfig fields, e.g. num_blocks=4096 max_batch_tokens=8192 (default: none, the "
        "engine's defaults)",
    )
    return parser


def check_flags(args: argparse.Namespace) -> None:
    """Flag values and combinations that cannot work, found before anything loads.

    Raises:
        EvalError: naming the flag and what to do.
    """
    positive = dict(
        n=args.n, max_new_tokens=args.max_new_tokens, num_samples=args.num_samples, max_line_chars=args.max_line_chars
    )
    for name, value in positive.items():
        if value is not None and value < 1:
            raise EvalError(f"--{name.replace('_', '-')} {value}: must be at least 1")
    for name in ("device", "metric", "split"):  # typed empty, each read as unset: the default ran silently
        value = getattr(args, name)
        if value is not None and not value.strip():
            raise EvalError(f"--{name} {value!r}: empty; give a value, or leave the flag out for its default")
    if args.compare_with_generate < 0:
        raise EvalError(f"--compare-with-generate {args.compare_with_generate}: must be 0 (off) or more")
    if args.temperature is None:  # n samples of one prompt are only worth drawing if they can differ
        args.temperature = 0.0 if args.n == 1 else SAMPLED_TEMPERATURE
    if not (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature < math.inf):
        raise EvalError(f"--temperature {args.temperature}: must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise EvalError(f"--top-p {args.top_p}: must be in (0, 1]")
    greedy = args.temperature == 0
    if greedy and args.n > 1:
        raise EvalError(
            f"--n {args.n} with greedy decoding (--temperature 0) gives {args.n} identical samples: pass "
            f"--temperature above 0 to sample (without --temperature, --n above 1 samples at {SAMPLED_TEMPERATURE})"
        )
    if greedy and args.top_p is not None and args.top_p < 1:
        raise EvalError(f"--top-p {args.top_p} has no effect with greedy decoding: pass --temperature above 0")
    if args.top_k is not None and args.top_k < 0:
        raise EvalError(f"--top-k {args.top_k}: must be 0 (off) or more")
    if greedy and args.top_k is not None:
        raise EvalError(f"--top-k {args.top_k} has no effect with greedy decoding: pass --temperature above 0")
    if greedy and args.seed is not None:
        raise EvalError(f"--seed {args.seed} has no effect with greedy decoding: pass --temperature above 0")
    if args.compare_with_generate and not greedy:
        raise EvalError(
            f"--compare-with-generate compares greedy decoding token by token, which sampling at temperature "
            f"{args.temperature} cannot match: use --n 1 and --temperature 0 (greedy), or drop --compare-with-generate"
        )
    if args.metric is not None and args.answer_field is None:
        raise EvalError(f"--metric {args.metric} scores against reference answers: pass --answer-field too")
    if args.output is not None:
        check_output(args.output, args.dataset)


def _counted_in_split(args: argparse.Namespace, message: str) -> str:
    """Where a message's row (the output's prompt_index) counts from under a sliced --split: the slice's first row,
    not the file's (a file's reading errors name its own lines and rows, and say `--dataset` first)."""
    sliced = args.split is not None and "[" in args.split
    if not sliced or message.startswith("--dataset") or "--split" in message or not re.search(r"\brow \d", message):
        return ""
    return f" (rows count from the first of --split {args.split})"


def _stopped_by(received: list[int]) -> str:
    """What stopped the run, as the message says it."""
    return "terminated (SIGTERM)" if received and received[0] == signal.SIGTERM else "interrupted"


def main(argv: list[str] | None = None) -> int:
    """Run rollout-eval; returns the exit status (0; 2 on an error the user can fix; 130 when interrupted, 143 when
    terminated: the rows so far are written either way)."""
    args = build_parser().parse_args(argv)
    # What an interrupt turned into is the interrupt (cli/interrupts.py); SIGTERM (a job scheduler's stop, `kill`)
    # stops the run as Ctrl-C does, keeping the rows it has.
    with recording_sigint(terminate=True) as interrupted:
        try:
            check_flags(args)
            with deferring_sigint(terminate=True, into=interrupted):  # torch and transformers load here
                from rollout.eval.session import evaluate

            summary, lines = evaluate(args, lambda rows: write_rows(args.output, rows))
            if args.compare_with_generate > summary["prompts"]:
                lines.append(
                    f"(--compare-with-generate {args.compare_with_generate}: "
                    f"the dataset has {summary['prompts']} prompts)"
                )
            written = None if args.output is None else write_summary(args.output, summary)  # before any print:
            # a reader of the output that went away (`| head`) must not cost the file
            print("\n".join(lines), flush=True)
            if written is not None:
                print(f"rows: {args.output} ({summary['samples']}), summary: {written}", flush=True)
        except EvalError as error:
            print(f"rollout-eval: error: {error}{_counted_in_split(args, str(error))}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as interrupt:
            # e.g. " while generating; the rows are in ..." (another interrupt's message is not this command's)
            where = str(interrupt).removeprefix("interrupted") if isinstance(interrupt, EvalInterrupted) else ""
            print(f"rollout-eval: {_stopped_by(interrupted)}{where}", file=sys.stderr)
            return 128 + (interrupted[0] if interrupted else signal.SIGINT)
        except Exception:
            if not interrupted:
                raise
            print(f"rollout-eval: {_stopped_by(interrupted)}", file=sys.stderr)
            return 128 + interrupted[0]
    return 0


def console_main(argv: list[str] | None = None) -> NoReturn:
    """The `rollout-eval` console script: `main`, then the process ends at once (`exit_now`: its threads joined and
    exit hooks run, without the interpreter's seconds-long teardown of every object).

    Args:
        argv: the arguments (None: the command line's).
    """
    run_console_script(main, argv)


if __name__ == "__main__":
    console_main()
