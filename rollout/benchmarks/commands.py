"""Running a parsed `rollout-bench` subcommand (`cli.main` imports this module only once the flags parse: the
benchmarks load torch, transformers and the engine, which `--help` and a typo'd flag must not wait for)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from rollout.benchmarks import load, plots
from rollout.benchmarks.gpu_report import report as gpu_report
from rollout.benchmarks.grpo import grpo, grpo_step, long_tail
from rollout.benchmarks.grpo.long_tail_flags import check_arguments as check_long_tail
from rollout.benchmarks.service import agentic, fairness, fleet, lora_push, service, weights
from rollout.benchmarks.structured import structured
from rollout.benchmarks.structured.structured_flags import check_arguments as check_structured
from rollout.benchmarks.throughput import throughput
from rollout.cli.device_names import check_device_name
from rollout.cli.extras import require_extra
from rollout.cli.parser import CliParser
from rollout.process_groups import process_age_s


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Check the parsed flags' combinations, run the subcommand, print its summary as one line of JSON.

    Args:
        args: `rollout-bench`'s parsed flags.
        parser: its parser; `error` reports a usage error (exit status 2), naming the flag.
    """
    if args.command == "gpu-report":
        raise SystemExit(gpu_report.main(args, parser))
    if isinstance(parser, CliParser):  # the subcommand's errors point at its own --help
        parser = parser.subcommand_parser(args)
    if args.command == "long-tail":  # its flags' combinations first: they are wrong on any machine
        check_long_tail(parser, args)
    elif args.command == "structured":
        check_structured(parser, args)
    device = getattr(args, "device", None)
    if isinstance(device, str):  # (weights' --device is free text; the others' are argparse choices)
        try:
            check_device_name(device, f"--device {device}")
        except ValueError as error:
            parser.error(str(error))
    if isinstance(device, str) and device.startswith("cuda"):  # one line now, not each system's traceback
        import torch

        if not torch.cuda.is_available():
            build = "" if torch.version.cuda else f"; torch {torch.__version__} is a build without CUDA"
            parser.error(f"--device {device}: no CUDA device is available{build}")
    for flag in ("system_timeout", "time_budget"):
        value = getattr(args, flag, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{flag.replace('_', '-')} must be a number > 0, got {value}")
    if args.command == "throughput" and args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.command == "grpo-step" and args.model != "tiny" and args.device == "cpu":
        parser.error(f"--model {args.model} is a GPU shape: run it with --device cuda")
    if getattr(args, "num_prompts", None) is not None and args.num_prompts < 1:
        parser.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.command == "fleet":
        try:  # Ray loads only once the run starts: its absence is one line now, naming the pip command
            require_extra("ray", "rollout-bench fleet")
        except ImportError as error:
            parser.error(str(error))
    if getattr(args, "plot", None) is not None:
        if getattr(args, "routing_replay", False):
            parser.error("--plot draws the step split of grpo-step: not with --routing-replay")
        try:
            args.plot = plots.check_plot_request(args.plot)
        except (ValueError, ImportError) as error:  # a bad path, or matplotlib missing: one line, exit 2
            parser.error(str(error))
    if args.command == "grpo-step":
        if args.steps < 1:
            parser.error(f"--steps must be >= 1, got {args.steps}")
        bounds = None
        if args.max_staleness is not None:
            try:
                bounds = [int(k) for k in args.max_staleness.split(",")]
            except ValueError:
                parser.error(f"--max-staleness {args.max_staleness}: expected integers like 0,1,2")
            if any(k < 0 for k in bounds):
                parser.error(f"--max-staleness {args.max_staleness}: bounds must be >= 0")
            if args.systems:
                parser.error("--max-staleness runs rollout_server only: leave out --systems")
        if args.model != "tiny" and (bounds is not None or "rollout_server" in (args.systems or grpo_step.SYSTEMS)):
            parser.error(f"--model {args.model}: rollout_server runs the tiny preset only; pass --systems without it")
        if args.partial_rollouts and (bounds is not None or args.systems or args.model != "tiny"):
            parser.error(
                "--partial-rollouts runs rollout_server on the tiny model: leave out --max-staleness, --systems"
            )
        if args.routing_replay:
            if bounds is not None or args.systems or args.partial_rollouts or args.model != "tiny" or args.device:
                parser.error("--routing-replay runs its own MoE models on the CPU: leave out the other options")
            from rollout.benchmarks.grpo import routing_replay

            summary = routing_replay.run()
        else:
            summary = grpo_step.run(args.systems, args.device, args.steps, bounds, args.model, args.partial_rollouts)
    elif args.command == "grpo":
        summary = grpo.run(args.device, args.seed, not args.no_transformers, args.num_prompts, args.speculative)
    elif args.command == "throughput":
        summary = throughput.run(
            args.workload,
            args.systems,
            args.seed,
            args.repeats,
            args.details,
            warmup=not args.no_warmup,
            num_prompts=args.num_prompts,
            system_timeout_s=args.system_timeout,
            # The budget counts from this process's start: its imports took some of it.
            time_budget_s=None if args.time_budget is None else max(1.0, args.time_budget - process_age_s()),
            batch_invariant=args.batch_invariant,
        )
    elif args.command == "load":
        load.check_arguments(parser, args)
        summary = load.run(args)
    elif args.command == "long-tail":
        # The budget counts from this process's start, as throughput's: its imports took some of it.
        args.time_budget = max(1.0, args.time_budget - process_age_s())
        summary = long_tail.run(args)
    elif args.command == "structured":
        summary = structured.run(
            tuple(args.rows), args.vocab_size, args.steps, args.repeats, args.num_prompts, args.device
        )
    elif args.command == "fairness":
        if args.max_steps < 1:
            parser.error(f"--max-steps must be >= 1, got {args.max_steps}")
        summary = fairness.run(tuple(args.scenarios or fairness.SCENARIOS), args.max_steps, args.seed)
    elif args.command == "fleet":
        summary = fleet.run(args)
    elif args.command == "weights":
        if args.size_mb <= 0 or args.repeats < 1 or args.bucket_mb <= 0:
            parser.error("--size-mb and --bucket-mb must be > 0, --repeats >= 1")
        if args.lora_rank is not None:
            if args.lora_rank < 1:
                parser.error("--lora-rank must be >= 1")
            summary = lora_push.run(args.size_mb, args.lora_rank, args.repeats, args.device, args.dtype)
        else:
            summary = weights.run(args.size_mb, args.transports, args.repeats, args.bucket_mb, args.device, args.dtype)
    elif args.agentic:
        if args.path is not None:
            parser.error("--path measures the plain service benchmark: it has no effect with --agentic")
        # (`is None`, not `or`: a 0 given was the default, run silently)
        turns, episodes, workers = (
            default if value is None else value
            for value, default in ((args.turns, 10), (args.episodes, 16), (args.workers, 2))
        )
        for flag, value, least in (("--turns", turns, 2), ("--episodes", episodes, 1), ("--workers", workers, 1)):
            if value < least:
                parser.error(f"{flag} must be >= {least}, got {value}")
        summary = agentic.run(turns, episodes, workers, seed=args.seed)
    else:
        given = [flag for flag in ("turns", "episodes", "workers") if getattr(args, flag) is not None]
        if given:
            parser.error(f"--{given[0]} needs --agentic")
        summary = service.run(args.seed, args.path or "zmq")
    print(json.dumps(summary))
    if summary.get("interrupted"):  # what finished is printed above; no plot of a part
        print(f"rollout-bench {args.command}: interrupted; what finished is reported above", file=sys.stderr)
        raise SystemExit(130)
    if getattr(args, "plot", None) is not None:
        try:
            written = plots.PLOTTERS[args.command](summary, args.plot)
        except Exception as error:  # noqa: BLE001 - the run is done and printed: one line, not a traceback
            print(f"--plot {args.plot}: not written ({error!r}); the summary above is complete", file=sys.stderr)
            raise SystemExit(1) from None
        print(f"plot: {written} ({written.stat().st_size / 1024:.0f} KB)", file=sys.stderr, flush=True)
    if args.command == "load" and not summary["passed"]:
        raise SystemExit(1)  # a group lost or duplicated, KV blocks left in use, or a fuzzed worker stopped serving
    if args.command == "service" and args.agentic and not summary["passed"]:
        raise SystemExit(1)  # above the goal of computed / new prompt tokens with affinity
