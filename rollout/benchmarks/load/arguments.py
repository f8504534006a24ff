"""The flags of `rollout-bench load`, and the usage errors for impossible settings."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `rollout-bench load`."""
    add = parser.add_argument
    add("--clients", type=int, default=16, help="client processes (default: 16)")
    add("--groups", type=int, default=20, help="groups per client (default: 20)")
    add("--n", type=int, default=4, help="samples per group (default: 4)")
    add("--prompt-len", type=int, default=16, help="prompt tokens, random ids (default: 16)")
    add("--max-new-tokens", type=int, default=32, help="sampled tokens per sample, no stop token (default: 32)")
    add(
        "--in-flight",
        type=int,
        default=0,
        help="groups each client keeps in flight (default: 0, all of its groups at once)",
    )
    add("--workers", type=int, choices=(1, 2), default=1, help="rollout-worker processes (default: 1)")
    add("--kill-one", action="store_true", help="SIGKILL the first of two workers mid-run (needs --workers 2)")
    add(
        "--kill-at",
        type=float,
        default=0.25,
        help="with --kill-one: kill once this fraction of the groups has returned and the worker has groups in "
        "flight (default: 0.25; 0: as soon as it has some)",
    )
    add(
        "--dead-after",
        type=float,
        default=10.0,
        help="seconds a client waits on a silent worker before resubmitting its groups (default: 10)",
    )
    add("--fuzz", type=int, default=0, metavar="N", help="send N malformed messages during the load (default: 0)")
    add("--fuzz-seed", type=int, default=0, help="seed of the fuzzed messages (default: 0)")
    add("--seed", type=int, default=0, help="prompt and sampling seed (default: 0)")
    add("--timeout", type=float, default=600.0, help="seconds a client waits for any one group (default: 600)")
    add("--num-blocks", type=int, default=None, help="KV blocks per worker (default: the worker's)")
    add(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra rollout-worker argument, repeatable (e.g. --worker-arg=--max-num-seqs --worker-arg=64; default: none)",
    )


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors for impossible settings."""
    if min(args.clients, args.groups, args.n, args.prompt_len, args.max_new_tokens) < 1:
        parser.error("--clients, --groups, --n, --prompt-len and --max-new-tokens must be >= 1")
    if args.in_flight < 0 or args.fuzz < 0:
        parser.error("--in-flight and --fuzz must be >= 0")
    if args.kill_one and args.workers != 2:
        parser.error("--kill-one needs --workers 2 (the groups of the killed worker go to the other)")
    if not 0 <= args.kill_at < 1:
        parser.error("--kill-at must be in [0, 1)")
