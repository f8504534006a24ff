"""`rollout-bench`: benchmark subcommands. Each prints a table, then one line of JSON."""

from __future__ import annotations

import ast
import importlib.util
import signal
import sys
import threading
from typing import NoReturn

# Only modules free of torch here: the parser builds, and --help and flag errors answer, at once. The benchmarks
# themselves load in commands.py, imported once the flags parse.
from rollout.benchmarks import load, plots
from rollout.benchmarks.gpu_report import report as gpu_report
from rollout.benchmarks.grpo import grpo_step
from rollout.benchmarks.grpo.long_tail_flags import add_arguments as add_long_tail_arguments
from rollout.benchmarks.harness.choices import GRPO_NUM_PROMPTS, SERVICE_PATHS, SYSTEM_NAMES
from rollout.benchmarks.harness.workloads import WORKLOADS
from rollout.benchmarks.structured.structured_flags import add_arguments as add_structured_arguments
from rollout.cli.parser import CliParser
from rollout.cli.process_exit import run_console_script
from rollout.config import MODEL_DTYPE_NAMES
from rollout.process_groups import interrupt_on_signals
from rollout.protocol.transports import WEIGHT_TRANSPORTS


def build_parser() -> CliParser:
    """Every subcommand and its flags."""
    parser = CliParser(prog="rollout-bench", description=__doc__)
    parser.add_version_flag()
    commands = parser.add_subparsers(dest="command", required=True)
    tp = commands.add_parser(
        "throughput",
        help="generated tokens/s vs transformers' generate_batch and generate",
        description=_docstring("rollout.benchmarks.throughput.throughput"),
    )
    tp.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="cpu-small",
        help="workload, see docs/concepts/architecture.md, Benchmark workloads",
    )
    tp.add_argument(
        "--systems",
        nargs="+",
        choices=sorted(SYSTEM_NAMES),
        default=None,
        help="systems to run, in order, each in its own process (default: rollout, transformers_generate_batch "
        "and transformers_generate for cpu-small; rollout, rollout_sequential and transformers_generate_batch for "
        "nano)",
    )
    tp.add_argument(
        "--batch-invariant",
        action="store_true",
        help="also run rollout_invariant (batch_invariant=True) right after rollout: the mode's price, side by side",
    )
    tp.add_argument("--seed", type=int, default=0, help="model and prompt seed")
    tp.add_argument(
        "--num-prompts", type=int, default=None, help="requests to run (default: the workload's; fewer: a quick run)"
    )
    tp.add_argument("--repeats", type=int, default=3, help="runs per system, median reported")
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
        "service",
        help="tokens/s through a rollout-worker (ZeroMQ, HTTP) vs in-process (cpu-small)",
        description=_docstring("rollout.benchmarks.service.service"),
    )
    sv.add_argument("--seed", type=int, default=0, help="prompt seed")
    sv.add_argument(
        "--path",
        choices=SERVICE_PATHS,
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
    fa = commands.add_parser(
        "fairness",
        help="a second client's short request behind a first client's work: its wait in steps and seconds, with the "
        "express lane open and closed (in-process, tiny preset)",
        description=_docstring("rollout.benchmarks.service.fairness"),
    )
    fa.add_argument(
        "--scenarios",
        nargs="+",
        choices=("tight-cache", "wide-group"),  # fairness.SCENARIOS' names (that module loads torch)
        default=None,
        help="scenarios to run, in order (default: both): tight-cache (many long groups in a cache holding a third "
        "of them), wide-group (one group of twice max_num_seqs samples)",
    )
    fa.add_argument(
        "--max-steps",
        type=int,
        default=1000,
        help="engine steps per run at most; a request not finished by then is reported as not finished",
    )
    fa.add_argument("--seed", type=int, default=0, help="model, prompt and sampling seed")
    wt = commands.add_parser(
        "weights",
        help="push_weights GB/s per transport over loopback, and the commit pause",
        description=_docstring("rollout.benchmarks.service.weights"),
    )
    wt.add_argument("--size-mb", type=float, default=512, help="state dict size in MB")
    wt.add_argument(
        "--transports", nargs="+", choices=WEIGHT_TRANSPORTS, default=None, help="transports (default: all)"
    )
    wt.add_argument("--repeats", type=int, default=3, help="pushes per transport, median reported")
    wt.add_argument("--bucket-mb", type=float, default=64, help="bucket size in MB")
    wt.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="instead: adapter-only pushes of a PEFT LoRA model of this rank (every Linear layer) against merged "
        "pushes of it, bytes and seconds side by side (needs peft; default: none, full-weight pushes)",
    )
    wt.add_argument("--device", default="cpu", help="the worker's device and the pushed model's: cpu, cuda or cuda:N")
    wt.add_argument(
        "--dtype",
        choices=[name for name in MODEL_DTYPE_NAMES if name != "auto"],
        default="float32",
        help="parameter dtype on both sides",
    )
    gr = commands.add_parser(
        "grpo",
        help=f"GRPO groups ({GRPO_NUM_PROMPTS} prompts x n=8): tokens/s and prompt tokens computed",
        description=_docstring("rollout.benchmarks.grpo.grpo"),
    )
    gr.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    gr.add_argument("--seed", type=int, default=0, help="model and prompt seed")
    gr.add_argument("--no-transformers", action="store_true", help="skip transformers' generate_batch")
    gr.add_argument("--num-prompts", type=int, default=GRPO_NUM_PROMPTS, help="groups to run")
    gr.add_argument(
        "--speculative",
        choices=["suffix"],
        default=None,
        help="also run rollout with this speculative decoding, in a process of its own (default: not)",
    )
    gs = commands.add_parser(
        "grpo-step",
        help="whole GRPO steps of the main job: rollout colocated and server vs TRL's generate and generate_batch",
        description=grpo_step.__doc__,
    )
    gs.add_argument(
        "--systems",
        nargs="+",
        choices=grpo_step.SYSTEMS + grpo_step.EXTRA_SYSTEMS,
        default=None,
        help="systems to run (default: the first four; rollout_colocate_no_is: colocated without TRL's "
        "importance-sampling forward; rollout_colocate_invariant: colocated with batch_invariant=True, that forward "
        "skipped)",
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
        "max_staleness=k) instead of the four systems (default: none)",
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
        )
    )
    fl = commands.add_parser(
        "fleet",
        help="RolloutFleet on Ray: launch to first group, a killed worker serving again, gloo fan-out GB/s",
        description=_docstring("rollout.benchmarks.service.fleet"),
    )
    fl.add_argument("--model", default="tiny", help="tiny or sized:<MB>")
    fl.add_argument("--workers", type=int, default=2, help="workers in the fleet")
    fl.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: 1 CPU per worker; cuda: 1 GPU")
    fl.add_argument("--repeats", type=int, default=3, help="pushes per fan-out size, median reported")
    lt = commands.add_parser(
        "long-tail",
        help="GRPO samples of lognormal lengths (median 2048, cap 16384) in a KV cache 0.27 of peak demand: "
        "recompute ratio, swap, steps, batch size, last/median finish",
        description=_docstring("rollout.benchmarks.grpo.long_tail"),
    )
    add_long_tail_arguments(lt)
    plots.add_plot_argument(
        lt,
        "tokens computed (prompts, decodes, recomputed after preemption) and the decoding batch per step against "
        "what the cache holds",
    )
    add_structured_arguments(
        commands.add_parser(
            "structured",
            help="what structured outputs cost: host time at 64/256 constrained rows, compile time cold/cached, "
            "throughput constrained vs not (cpu-small)",
            description=_docstring("rollout.benchmarks.structured.structured"),
        )
    )
    gpu_report.add_arguments(
        commands.add_parser(
            "gpu-report",
            help="every GPU figure and the GPU tests in one run: a markdown table and a JSON file",
            description=gpu_report.__doc__,
        )
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `rollout-bench` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from rollout.benchmarks.commands import run  # the benchmarks (torch, transformers, the engine) load here

    if threading.current_thread() is not threading.main_thread():
        return run(args, parser)
    # SIGTERM (a timeout, a section killed by gpu-report) and SIGINT unwind alike: the systems' and sections' own
    # process groups are killed on the way out, never left running. The caller's handlers come back afterwards.
    previous = interrupt_on_signals()
    try:
        return run(args, parser)
    except KeyboardInterrupt:  # what finished was printed as it finished; one line, not a traceback
        print(f"rollout-bench {args.command}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _docstring(module: str) -> str | None:
    """A module's docstring, read from its source without importing it (a subcommand's `--help` text lives in the
    module that runs it, whose imports take seconds)."""
    spec = importlib.util.find_spec(module)
    with open(spec.origin, encoding="utf-8") as source:
        return ast.get_docstring(ast.parse(source.read()), clean=False)


def console_main(argv: list[str] | None = None) -> NoReturn:
    """The `rollout-bench` console script (and `python -m rollout.benchmarks.cli`, how gpu-report runs each section):
    `main`, then the process ends at once (`exit_now`: its threads joined and exit hooks run, without the
    interpreter's seconds-long teardown of every object torch made).

    Args:
        argv: the arguments (None: the command line's).
    """
    run_console_script(lambda args: main(args) or 0, argv)


if __name__ == "__main__":
    console_main()
