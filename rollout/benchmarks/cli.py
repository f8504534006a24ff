"""`rollout-bench`: benchmark subcommands. Each prints a table, then one line of JSON."""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading

from rollout.benchmarks import (
    agentic,
    fleet,
    gpu_report,
    grpo,
    grpo_step,
    load,
    long_tail,
    lora_push,
    plots,
    service,
    structured,
    systems,
    throughput,
    weights,
    workloads,
)
from rollout.extras import require_extra
from rollout.process_groups import interrupt_on_signals, process_age_s
from rollout.service.presets import MODEL_DTYPES


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its flags."""
    parser = argparse.ArgumentParser(prog="rollout-bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    tp = commands.add_parser("throughput", help="generated tokens/s vs transformers' generate_batch and generate")
    tp.add_argument(
        "--workload",
        choices=sorted(workloads.WORKLOADS),
        default="cpu-small",
        help="workload, see docs/concepts/architecture.md, Benchmark workloads (default: cpu-small)",
    )
    tp.add_argument(
        "--systems",
        nargs="+",
        choices=sorted(systems.SYSTEMS),
        default=None,
        help="systems to run, in order, each in its own process (default: rollout, transformers_generate_batch "
        "and transformers_generate for cpu-small; rollout, rollout_sequential and transformers_generate_batch for "
        "nano)",
    )
    tp.add_argument("--seed", type=int, default=0, help="model and prompt seed (default: 0)")
    tp.add_argument(
        "--num-prompts", type=int, default=None, help="requests to run (default: the workload's; fewer: a quick run)"
    )
    tp.add_argument("--repeats", type=int, default=3, help="runs per system, median reported (default: 3)")
    tp.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip each system's untimed warm-up (rollout: every decode graph captured, every prompt prefilled and the "
        "longest requests run, so compilation is not timed; transformers: a few short prompts)",
    )
    tp.add_argument(
        "--system-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="each system's own time limit, warm-up and repeats included; a system past it is reported as a timeout "
        "and the others still run (default: 600 for cpu-small, 420 for nano)",
    )
    tp.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the most the whole run may take: each system gets at most an equal share of what is left when it "
        "starts (--details counts as half a system, and gets all that is left); transformers' systems stop at "
        "their share and report what they finished (default: no budget)",
    )
    tp.add_argument(
        "--details",
        action="store_true",
        help="also report the decode roofline fraction, peak memory and logprob fidelity (one more rollout run)",
    )
    plots.add_plot_argument(tp, "generated tokens/s per system, median run with min-max whiskers over --repeats")
    sv = commands.add_parser(
        "service", help="tokens/s through a rollout-worker (ZeroMQ, HTTP) vs in-process (cpu-small)"
    )
    sv.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    sv.add_argument(
        "--path",
        choices=service.PATHS,
        default=None,
        help="zmq: ZeroMQ results and streams; http: the OpenAI HTTP API's results and streams beside ZeroMQ "
        "results (the reference); all: both (default: zmq)",
    )
    sv.add_argument(
        "--agentic",
        action="store_true",
        help="instead: a synthetic multi-turn agent on a fleet of workers, prompt tokens computed / new tokens per "
        "turn with and without prefix-affine routing (goal: at most 1.2 with it)",
    )
    sv.add_argument("--turns", type=int, default=None, help="--agentic: turns per episode (default: 10)")
    sv.add_argument("--episodes", type=int, default=None, help="--agentic: conversations side by side (default: 16)")
    sv.add_argument("--workers", type=int, default=None, help="--agentic: rollout-worker processes (default: 2)")
    wt = commands.add_parser("weights", help="push_weights GB/s per transport over loopback, and the commit pause")
    wt.add_argument("--size-mb", type=float, default=512, help="state dict size in MB (default: 512)")
    wt.add_argument(
        "--transports", nargs="+", choices=weights.TRANSPORTS, default=None, help="transports (default: all)"
    )
    wt.add_argument("--repeats", type=int, default=3, help="pushes per transport, median reported (default: 3)")
    wt.add_argument("--bucket-mb", type=float, default=64, help="bucket size in MB (default: 64)")
    wt.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="instead: adapter-only pushes of a PEFT LoRA model of this rank (every Linear layer) against merged "
        "pushes of it, bytes and seconds side by side (needs peft)",
    )
    wt.add_argument("--device", default="cpu", help="the worker's device and the pushed model's: cpu, cuda or cuda:N")
    wt.add_argument(
        "--dtype",
        choices=sorted(name for name in MODEL_DTYPES if name != "auto"),
        default="float32",
        help="parameter dtype on both sides (default: float32)",
    )
    gr = commands.add_parser("grpo", help="GRPO groups (32 prompts x n=8): tokens/s and prompt tokens computed")
    gr.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    gr.add_argument("--seed", type=int, default=0, help="model and prompt seed (default: 0)")
    gr.add_argument("--no-transformers", action="store_true", help="skip transformers' generate_batch")
    gr.add_argument(
        "--num-prompts", type=int, default=grpo.NUM_PROMPTS, help=f"groups to run (default: {grpo.NUM_PROMPTS})"
    )
    gs = commands.add_parser(
        "grpo-step",
        help="whole GRPO steps of the main job: rollout colocated and server vs TRL's generate and generate_batch",
        description=grpo_step.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gs.add_argument(
        "--systems",
        nargs="+",
        choices=grpo_step.SYSTEMS + grpo_step.EXTRA_SYSTEMS,
        default=None,
        help="systems to run (default: the first four; rollout_colocate_no_is: colocated without TRL's "
        "importance-sampling forward)",
    )
    gs.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    gs.add_argument(
        "--steps",
        type=int,
        default=grpo_step.STEPS,
        help=f"timed steps per system, after {grpo_step.WARMUP_STEPS} warm-up steps (default: {grpo_step.STEPS})",
    )
    gs.add_argument(
        "--model",
        choices=sorted(grpo_step.MODEL_SHAPES),
        default="tiny",
        help="the policy: tiny (the main job's model, default) or nano (the Qwen3-0.6B architecture, bf16 mixed "
        "precision, 32 rows of 256 new tokens; not with rollout_server)",
    )
    gs.add_argument(
        "--max-staleness",
        default=None,
        help="comma-separated bounds, e.g. 0,1,2: run rollout_server once per bound (RolloutGRPOTrainer "
        "max_staleness=k) instead of the four systems",
    )
    gs.add_argument(
        "--routing-replay",
        action="store_true",
        help="MoE routing replay in bf16 (a tiny Qwen3-MoE and a tiny Mixtral, 64 experts, 8 per token): TRL's step "
        "1 without and with RolloutGRPOTrainer(routing_replay=True): routing decisions that differ, |logprob delta| "
        "mean and p99, TRL's importance ratio",
    )
    gs.add_argument(
        "--partial-rollouts",
        action="store_true",
        help="rollout_server on the long-tail shape (forced lognormal lengths, median 32, cap 256): synchronous, "
        "max_staleness=1, and max_staleness=1 with partial_rollouts",
    )
    plots.add_plot_argument(gs, "seconds per step of each system (or run), stacked: generation, weight sync, training")
    load.add_arguments(
        commands.add_parser(
            "load",
            help="N client processes against 1-2 workers over loopback: groups/s, p50/p99 latency, exactly-once, RSS, "
            "KV blocks left; --kill-one, --fuzz N",
            description=load.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    fleet.add_arguments(
        commands.add_parser(
            "fleet",
            help="RolloutFleet on Ray: launch to first group, a killed worker serving again, gloo fan-out GB/s",
            description=fleet.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    lt = commands.add_parser(
        "long-tail",
        help="GRPO samples of lognormal lengths (median 2048, cap 16384) in a KV cache 0.27 of peak demand: "
        "recompute ratio, swap, steps, batch size, last/median finish",
        description=long_tail.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    long_tail.add_arguments(lt)
    plots.add_plot_argument(
        lt,
        "tokens computed (prompts, decodes, recomputed after preemption) and the decoding batch per step against "
        "what the cache holds",
    )
    structured.add_arguments(
        commands.add_parser(
            "structured",
            help="what structured outputs cost: host time at 64/256 constrained rows, compile time cold/cached, "
            "throughput constrained vs not (cpu-small)",
            description=structured.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    gpu_report.add_arguments(
        commands.add_parser(
            "gpu-report",
            help="every GPU figure and the GPU tests in one run: a markdown table and a JSON file",
            description=gpu_report.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `rollout-bench` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _run(args, parser)
    # SIGTERM (a timeout, a section killed by gpu-report) and SIGINT unwind alike: the systems' and sections' own
    # process groups are killed on the way out, never left running. The caller's handlers come back afterwards.
    previous = interrupt_on_signals()
    try:
        return _run(args, parser)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Run the parsed subcommand."""
    if args.command == "gpu-report":
        raise SystemExit(gpu_report.main(args, parser))
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
            from rollout.benchmarks import routing_replay

            summary = routing_replay.run()
        else:
            summary = grpo_step.run(args.systems, args.device, args.steps, bounds, args.model, args.partial_rollouts)
    elif args.command == "grpo":
        summary = grpo.run(args.device, args.seed, not args.no_transformers, args.num_prompts)
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
        )
    elif args.command == "load":
        load.check_arguments(parser, args)
        summary = load.run(args)
    elif args.command == "long-tail":
        long_tail.check_arguments(parser, args)
        summary = long_tail.run(args)
    elif args.command == "structured":
        structured.check_arguments(parser, args)
        summary = structured.run(
            tuple(args.rows), args.vocab_size, args.steps, args.repeats, args.num_prompts, args.device
        )
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
        turns, episodes, workers = args.turns or 10, args.episodes or 16, args.workers or 2
        if turns < 2 or episodes < 1 or workers < 1:
            parser.error("--turns must be >= 2, --episodes and --workers >= 1")
        summary = agentic.run(turns, episodes, workers, seed=args.seed)
    else:
        given = [flag for flag in ("turns", "episodes", "workers") if getattr(args, flag) is not None]
        if given:
            parser.error(f"--{given[0]} needs --agentic")
        summary = service.run(args.seed, args.path or "zmq")
    print(json.dumps(summary))
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


if __name__ == "__main__":
    main()
