"""The flags of `rollout-bench structured` (what it measures: structured.py's docstring, its `--help` text) and the
usage errors for impossible settings. Free of torch: the parser imports it."""

from __future__ import annotations

import argparse

from rollout.benchmarks.structured.bench_tokenizer import DEFAULT_VOCAB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `rollout-bench structured`.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="constrained rows of the host time")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB,
        help="the bench tokenizer's vocabulary",
    )
    parser.add_argument("--steps", type=int, default=60, help="decode steps timed per host-time figure (default: 60)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="throughput runs per system, median reported; 0 skips it (default: 1)"
    )
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="throughput requests (default: the workload's; fewer: quicker)"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: throughput on cpu-small; cuda: host time on the GPU, throughput on nano (default: cpu)",
    )


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse out-of-range flags by name (parser.error exits)."""
    if any(rows < 1 for rows in args.rows):
        parser.error(f"--rows must be >= 1, got {args.rows}")
    if args.vocab_size < 1000:
        parser.error(f"--vocab-size must be >= 1000, got {args.vocab_size}")
    if args.steps < 1 or args.repeats < 0:
        parser.error("--steps must be >= 1 and --repeats >= 0")
