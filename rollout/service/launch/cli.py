"""`rollout-worker`: serve a model over ZeroMQ for trainers and, with --http, over the OpenAI-compatible HTTP API.

Every option can also come from an environment variable ROLLOUT_<OPTION> (upper case, dashes as underscores, e.g.
ROLLOUT_BIND, ROLLOUT_MAX_BATCH_TOKENS); a flag given on the command line wins over the environment.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import NoReturn

# Only light modules here: the parser builds, and --help and flag errors answer, before torch, transformers and the
# engine load (startup.py loads them, once the flags parse and the settings check).
from rollout.cli.interrupts import deferring_sigint, recording_sigint
from rollout.cli.parser import CliParser
from rollout.cli.process_exit import run_console_script
from rollout.config import ATTENTION_BACKENDS, MODEL_DTYPE_NAMES, SCHEDULER_TYPES, ContinuousBatchingConfig
from rollout.presets.catalog import PRESETS
from rollout.service.http.control.flags import add_control_arguments
from rollout.service.http.serving.flags import add_http_arguments
from rollout.service.launch.flags import AUTO_ON_OFF, FIELD_FLAGS, OTHER_TOOLS_FLAGS, check_settings, percent
from rollout.service.launch.speculative_flags import add_speculative_arguments
from rollout.service.zmq.limits import WorkerLimits

__all__ = ["FIELD_FLAGS", "build_parser", "main"]

logger = logging.getLogger("rollout.worker")


def build_parser() -> CliParser:
    """The command-line interface (defaults may come from ROLLOUT_* environment variables)."""
    parser = CliParser(
        prog="rollout-worker", description=__doc__, field_flags=FIELD_FLAGS, other_tools_flags=OTHER_TOOLS_FLAGS
    )
    parser.add_version_flag()
    add = parser.add_argument
    add(
        "--model",
        default="tiny",
        help="a local Hugging Face model directory, a hub id, or a preset: "
        f"{', '.join(PRESETS)} (default: tiny, a random Qwen3-style model built in code; tiny-moe its MoE version; "
        "tiny-agent a scripted tool caller, for agentic rollouts; sized:512 is a random model with about 512 MB of weights, for weight-transfer benchmarks)",
    )
    add(
        "--tokenizer",
        default=None,
        help="a local tokenizer directory or hub id, for stop strings and (with --http) the OpenAI endpoints, which "
        "answer in text whatever the prompt; 'none' serves without one: ZeroMQ token ids only, the text endpoints "
        "answer 400 (default: the preset's built-in tokenizer, else the model directory's, if any)",
    )
    add(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model's name in the OpenAI API (/v1/models, and what a request's `model` must be) and in the "
        "ZeroMQ hello, as vLLM's flag (default: --model as given, a directory's whole path included)",
    )
    place = parser.add_mutually_exclusive_group()
    place.add_argument("--gpu", type=int, default=None, help="CUDA device index to serve on (default: none, --device)")
    place.add_argument("--device", default=None, help="torch device, e.g. cpu (default: cpu unless --gpu)")
    add(
        "--dtype",
        choices=MODEL_DTYPE_NAMES,
        default="auto",
        help="parameter dtype (auto: the checkpoint's, fp32 presets)",
    )
    add("--bind", default="tcp://127.0.0.1:5555", help="ZeroMQ address to bind")
    add_http_arguments(add)
    add_control_arguments(add)
    engine = ContinuousBatchingConfig()  # the engine's defaults are the flags' (one source of truth)
    add("--block-size", type=int, default=engine.block_size, help="tokens per KV block")
    add("--num-blocks", type=int, default=None, help="KV blocks (default: sized by --max-memory-percent)")
    add(
        "--max-memory-percent",
        type=percent,
        default=None,
        metavar="PERCENT",
        help="percent of the free device memory (once the model is loaded) the KV cache takes unless --num-blocks "
        "is given: 90 means 90%% (default: 90 on a GPU, 5 of the available RAM on a CPU)",
    )
    add("--max-batch-tokens", type=int, default=engine.max_batch_tokens, help="token budget per engine step")
    add("--max-num-seqs", type=int, default=engine.max_num_seqs, help="most sequences per engine step")
    add(
        "--max-model-len",
        type=int,
        default=engine.max_model_len,
        help="longest prompt + completion a request may ask for, in tokens, as vLLM's flag (default: the model's "
        "context, its max_position_embeddings)",
    )
    add("--scheduler", choices=SCHEDULER_TYPES, default=engine.scheduler_type, help="scheduling policy")
    add(
        "--max-queue-size",
        type=int,
        default=engine.max_queue_size,
        help="most waiting requests before 'busy'; 0: unbounded",
    )
    add(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve a PEFT LoRA adapter (a directory, or a hub id org/name) unmerged under NAME (repeatable); requests "
        "choose it by name (needs pip install 'rollout[lora]'); trainers may add or replace adapters while serving "
        "(default: none)",
    )
    add("--max-loras", type=int, default=engine.max_loras, help="most LoRA adapters served at once")
    add("--max-lora-rank", type=int, default=engine.max_lora_rank, help="highest LoRA rank accepted")
    add(
        "--cpu-offload-space",
        type=float,
        default=engine.cpu_offload_space,
        help="GiB of CPU swap for preempted requests; 0: they are recomputed",
    )
    limits = WorkerLimits()
    add(
        "--client-timeout",
        type=float,
        default=limits.client_timeout_s,
        help="seconds a client with groups in flight may stay silent before they are cancelled (RolloutClient "
        "pings every second)",
    )
    add(
        "--max-message-bytes",
        type=int,
        default=limits.max_message_bytes,
        help="largest frame accepted (larger ones drop the connection) and most data bytes per message after its "
        "header (larger messages are refused; keep it >= the trainers' bucket_bytes)",
    )
    add("--max-prompt-len", type=int, default=None, help="longest prompt in tokens (default: the model's context)")
    add("--max-n", type=int, default=limits.max_n, help="most samples per group")
    add(
        "--max-groups-per-client",
        type=int,
        default=limits.max_groups_per_client,
        help="most groups one client (with keys: one key, however many connections; else one connection) may have "
        "in flight; more are answered 'busy'; 0: no limit",
    )
    add(
        "--max-pending-bytes",
        type=int,
        default=limits.max_pending_bytes,
        help="most bytes of memory the replies kept for a client that does not read them may hold (their Python "
        "objects counted); past it the client is dropped and its groups cancelled",
    )
    add(
        "--max-update-phase-s",
        type=float,
        default=limits.max_update_phase_s,
        help="longest phase deadline (timeout_s) a weight update may ask for",
    )
    add(
        "--max-compile-s",
        type=float,
        default=limits.max_compile_s,
        help="seconds a structured-output constraint may take to compile (in a compile process of its own, killed "
        "past it); slower ones are refused by name",
    )
    add(
        "--max-compile-bytes",
        type=int,
        default=limits.max_compile_bytes,
        help="bytes of memory a structured-output constraint's compile may allocate; more is refused by name",
    )
    add(
        "--max-compiles-per-client",
        type=int,
        default=limits.max_compiles_per_client,
        help="structured-output constraints one client may have compiling or waiting to compile (clients take turns "
        "at the compile processes); more are answered 'busy'",
    )
    add(
        "--preload-compiles",
        action="store_true",
        help="start the structured-output compile processes when the worker starts, so the first new constraint does "
        "not wait for them (seconds: they import xgrammar and torch); default: the first new constraint starts "
        "them, and a worker that serves none never runs them (json_object is compiled at start either way)",
    )
    add(
        "--curve-secret-key",
        default=None,
        help="this worker's CurveZMQ key pair (a .key_secret file from rollout-keygen): encrypt every connection "
        "and accept only the keys of --authorized-keys and --trainer-keys (default: none, unencrypted: a "
        "non-loopback --bind then needs --insecure)",
    )
    add(
        "--authorized-keys",
        default=None,
        help="directory of public keys (*.key) of clients that may generate (default: none)",
    )
    add(
        "--trainer-keys",
        default=None,
        help="directory of public keys (*.key) of trainers that may also push weights (default: none)",
    )
    add(
        "--insecure",
        action="store_true",
        help="allow binding a non-loopback address without --curve-secret-key (anyone who can reach it may push "
        "weights)",
    )
    add(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default=engine.attention_backend,
        help="paged attention kernels: auto (Triton on CUDA), torch, triton",
    )
    add(
        "--cuda-graphs",
        choices=sorted(AUTO_ON_OFF),
        default="auto",
        help="replay CUDA graphs for decode steps: auto (on CUDA with the Triton kernels), on, off",
    )
    add(
        "--overlap",
        choices=sorted(AUTO_ON_OFF),
        default="auto",
        help="schedule the next step while the device runs this one: auto (on CUDA), on, off",
    )
    add("--fp32-logits", action="store_true", help="compute the output projection and softmax in fp32 (bf16 models)")
    add_speculative_arguments(add)
    add(
        "--batch-invariant",
        action="store_true",
        help="compute each token's logits bit for bit as trainer_bridge.batch_invariant makes the trainer's forward "
        "compute them, whatever the batch and however a prompt was chunked or cached (LoRA adapters and MoE too)",
    )
    add(
        "--release-staging",
        action="store_true",
        help="free a weight update's host staging area after it (default: keep it for the next, faster update)",
    )
    add(
        "--check-finite",
        action="store_true",
        help="refuse a weight update holding NaN or Inf (one pass over the update at commit; the old weights serve on)",
    )
    add(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a free port; default: off)",
    )
    add("--metrics-host", default=None, help="address the metrics server listens on (default: 127.0.0.1)")
    add(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (any case)",
    )
    parser.defaults_from_environment("ROLLOUT_")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `rollout-worker`: load, bind, serve until SIGTERM/SIGINT, then abort in-flight groups."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_settings(parser, args)  # a bad setting is a usage error now, not after the imports below
    # Ctrl-C or SIGTERM while torch imports or the model loads: one line, not the traceback of wherever it landed,
    # nor of the error a half-done import turned it into (rollout/cli/interrupts.py); SIGTERM had killed the process
    # with no word of why.
    with recording_sigint(terminate=True) as interrupted:
        try:
            with deferring_sigint(terminate=True, into=interrupted):
                from rollout.service.launch.startup import (
                    start_worker,  # torch, transformers, the engine: only once the flags parse
                )

            logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            running = start_worker(parser, args)
        except BaseException as error:
            if not (isinstance(error, KeyboardInterrupt) or interrupted):
                raise
            print("rollout-worker: interrupted while starting", file=sys.stderr)
            return 128 + (interrupted[-1] if interrupted else signal.SIGINT)  # the shell's status for the signal
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: running.worker.shutdown())
    return running.serve()


def console_main(argv: list[str] | None = None) -> NoReturn:
    """The `rollout-worker` console script: `main`, then the process ends at once (`exit_now`: its threads joined and
    exit hooks run, without the interpreter's 1.5-3 s teardown of every object).

    Args:
        argv: the arguments (None: the command line's).
    """
    run_console_script(main, argv)


if __name__ == "__main__":
    console_main()
