"""The flags of `rollout-bench long-tail` (what it measures: long_tail.py's docstring, its `--help` text), the
workload shapes they default to, and the usage errors for impossible settings. Free of torch: the parser imports it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rollout.config import MAX_SPECULATIVE_TOKENS, SCHEDULER_TYPES, SPECULATIVE_METHODS, ContinuousBatchingConfig

TIME_BUDGET_S = 1200.0
DISABLE_BY_BATCH_SIZE = ContinuousBatchingConfig.speculative_disable_by_batch_size
NUM_SPECULATIVE_TOKENS = ContinuousBatchingConfig.num_speculative_tokens
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Shape:
    """How many samples, how long."""

    num_prompts: int
    n: int
    median_tokens: int
    max_tokens: int
    prompt_tokens: tuple[int, int]
    sigma: float = 1.0


SHAPES = {
    "stub": Shape(128, 8, 2048, 16384, (100, 1000)),
    "tiny": Shape(16, 4, 150, 1200, (20, 200)),
    "nano": Shape(16, 4, 150, 1200, (20, 200)),  # tiny's shape on the Qwen3-0.6B architecture (a GPU's model)
}
COMPUTED = ("tiny", "nano")  # the models computed for real (the stub's forward is ready logits)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `rollout-bench long-tail` (shape flags default to --model's shape).

    Args:
        parser: the subcommand's parser.
    """
    add = parser.add_argument
    add(
        "--model",
        choices=sorted(SHAPES),
        default="stub",
        help="stub (forward stubbed), tiny (the built-in tiny model) or nano (the Qwen3-0.6B architecture, bf16, "
        "random weights: --device cuda only), the last two computed for real",
    )
    add(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where --model tiny or nano runs (default: cpu); on cuda decode steps and drafted steps replay CUDA "
        "graphs, as an engine on a GPU does by default",
    )
    add("--num-prompts", type=int, default=None, help=f"prompts ({_by_model('num_prompts')})")
    add("--n", type=int, default=None, help=f"samples per prompt, each with its own length ({_by_model('n')})")
    add("--median-tokens", type=int, default=None, help=f"median output length ({_by_model('median_tokens')})")
    add("--max-tokens", type=int, default=None, help=f"output length cap ({_by_model('max_tokens')})")
    add("--sigma", type=float, default=Shape.sigma, help="sigma of the lognormal output lengths")
    add(
        "--prompt-tokens",
        type=int,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help=f"prompt lengths, uniform ({_by_model('prompt_tokens')})",
    )
    add("--cache-fraction", type=float, default=0.27, help="KV blocks as a fraction of peak demand")
    add("--cpu-offload-space", type=float, default=0.0, metavar="GIB", help="swap space, GiB; 0: recompute")
    add("--max-num-seqs", type=int, default=256, help="max_num_seqs: most sequences per step")
    add("--scheduler", choices=SCHEDULER_TYPES, default="fifo", help="scheduler_type")
    add("--seed", type=int, default=0, help="lengths, prompts and sampling seed")
    add(
        "--time-budget",
        type=float,
        default=TIME_BUDGET_S,
        metavar="SECONDS",
        help="stop the run this long after the command started, model and engine set-up included (with "
        "--speculative: every run together; a pair of runs starts only while the time left is at least what the "
        "pair before took)",
    )
    add(
        "--speculative",
        choices=[method for method in SPECULATIVE_METHODS if method],
        default=None,
        help="run the workload without and with this speculative decoding, side by side (--repeats times each; "
        "default: without only)",
    )
    # Unset (None) rather than their values, so that one typed without --speculative is refused even at its default.
    add(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help=f"with --speculative: draft tokens per sample and step (default: {NUM_SPECULATIVE_TOKENS})",
    )
    add(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        metavar="SAMPLES",
        help="with --speculative: drafts only in steps decoding at most this many samples (the engine's "
        f"speculative_disable_by_batch_size; default: {DISABLE_BY_BATCH_SIZE})",
    )
    add(
        "--repeats",
        type=int,
        default=None,
        help="with --speculative: runs of each, alternated, medians reported (default: 1)",
    )
    add(
        "--entropy",
        type=float,
        default=None,
        metavar="NATS",
        help="--model tiny or nano: scale its head to this mean next-token entropy (0.1: siblings agree; 1.5: "
        "realistic; default: the model as built)",
    )
    add(
        "--known-lengths",
        action="store_true",
        help="each sample's max_new_tokens is its length (else a stop token is pushed up at its length, which a "
        "low-entropy head outweighs)",
    )


def _by_model(field: str) -> str:
    """A shape flag's default for each --model, e.g. "default: stub 128, tiny 16"."""
    values = {model: getattr(shape, field) for model, shape in SHAPES.items()}
    shown = {model: " ".join(map(str, v)) if isinstance(v, tuple) else v for model, v in values.items()}
    return "default: " + ", ".join(f"{model} {value}" for model, value in shown.items())


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors for impossible settings; the speculative flags left unset (refused when given without
    --speculative, even at their defaults) get their defaults."""
    shape = shape_from(args)
    low, high = shape.prompt_tokens
    if min(shape.num_prompts, shape.n, shape.median_tokens, shape.max_tokens, low) < 1 or high < low:
        parser.error("--num-prompts, --n, --median-tokens, --max-tokens and --prompt-tokens must be >= 1, MIN <= MAX")
    if args.max_num_seqs < 1:
        parser.error("--max-num-seqs must be >= 1")
    if not (0 < args.cache_fraction and args.sigma >= 0 and args.cpu_offload_space >= 0):
        parser.error("--cache-fraction must be > 0, --sigma and --cpu-offload-space >= 0")
    if args.speculative is None:
        for flag, value, why in (
            ("--num-speculative-tokens", args.num_speculative_tokens, ""),
            ("--speculative-disable-by-batch-size", args.speculative_disable_by_batch_size, ""),
            ("--repeats", args.repeats, " (one run is made)"),
        ):
            if value is not None:
                parser.error(f"{flag} has no effect without --speculative suffix{why}")
    for name, default in (
        ("num_speculative_tokens", NUM_SPECULATIVE_TOKENS),
        ("speculative_disable_by_batch_size", DISABLE_BY_BATCH_SIZE),
        ("repeats", 1),
    ):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if not 1 <= args.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        parser.error(
            f"--num-speculative-tokens must be 1 to {MAX_SPECULATIVE_TOKENS}, got {args.num_speculative_tokens}"
        )
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.speculative_disable_by_batch_size < 1:
        parser.error(f"--speculative-disable-by-batch-size must be >= 1, got {args.speculative_disable_by_batch_size}")
    if args.speculative and getattr(args, "plot", None):
        parser.error("--plot draws one run; --speculative makes several: leave one of them out")
    if args.entropy is not None and (args.model not in COMPUTED or args.entropy <= 0):
        parser.error("--entropy needs --model tiny or nano and a value > 0")
    if args.device != "cpu" and args.model not in COMPUTED:
        parser.error("--device cuda needs --model tiny or nano (the stub model's forward is host work only)")
    if args.model == "nano" and args.device != "cuda":
        parser.error(
            "--model nano needs --device cuda (the Qwen3-0.6B architecture: a run would take an hour on a CPU)"
        )


def shape_from(args: argparse.Namespace) -> Shape:
    """The workload's shape: --model's, with the flags given."""
    base = SHAPES[args.model]
    given = {name: getattr(args, name) for name in ("num_prompts", "n", "median_tokens", "max_tokens", "prompt_tokens")}
    given = {name: tuple(v) if name == "prompt_tokens" else v for name, v in given.items() if v is not None}
    return Shape(**{**base.__dict__, **given, "sigma": args.sigma})
