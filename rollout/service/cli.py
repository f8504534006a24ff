"""`rollout-worker`: serve a model over ZeroMQ for trainers.

Every option can also come from an environment variable ROLLOUT_<OPTION> (upper case, dashes as underscores, e.g.
ROLLOUT_BIND, ROLLOUT_MAX_BATCH_TOKENS); a flag given on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from rollout.config import ATTENTION_BACKENDS, SCHEDULER_TYPES
from rollout.service.address_checks import check_bind
from rollout.service.http.settings import (
    DEFAULT_MAX_ANSWER_LOGPROBS,
    HEAD_TIMEOUT_S,
    KEEP_ALIVE_TIMEOUT_S,
    MAX_WAITING_CONNECTIONS,
    TOOL_CALL_PARSER_NAMES,
)
from rollout.service.limits import WorkerLimits
from rollout.service.preset_names import PRESETS
from rollout.service.presets import MODEL_DTYPES
from rollout.service.startup import AUTO_ON_OFF, start_worker

__all__ = ["build_parser", "check_bind", "main"]

logger = logging.getLogger("rollout.worker")


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (defaults may come from ROLLOUT_* environment variables)."""
    parser = argparse.ArgumentParser(
        prog="rollout-worker", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
        help="a local tokenizer directory or hub id, for stop strings and (with --http) text prompts and chat; "
        "'none' serves without one (default: the preset's built-in tokenizer, else the model directory's, if any)",
    )
    place = parser.add_mutually_exclusive_group()
    place.add_argument("--gpu", type=int, default=None, help="CUDA device index to serve on")
    place.add_argument("--device", default=None, help="torch device, e.g. cpu (default: cpu unless --gpu)")
    add(
        "--dtype",
        choices=sorted(MODEL_DTYPES),
        default="auto",
        help="parameter dtype (auto: the checkpoint's, fp32 presets)",
    )
    add("--bind", default="tcp://127.0.0.1:5555", help="ZeroMQ address to bind (default: tcp://127.0.0.1:5555)")
    add(
        "--http",
        default=None,
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
        "/tokenize, /detokenize, /health) on this address, over the same engine (needs pip install 'rollout[http]'; "
        "port 0 picks a free one)",
    )
    add(
        "--http-max-body-bytes",
        type=int,
        default=16 << 20,
        help="largest HTTP request body; larger ones are answered 413 (default: 16 MiB)",
    )
    add(
        "--http-max-receiving-bytes",
        type=int,
        default=None,
        help="most bytes of HTTP request bodies held at once (being received or parsed: a body's bytes plus 40 per "
        "JSON value and 32 more per string, what they take once parsed) for all clients; past it a request is "
        "answered 503 (default: twice the per-client share)",
    )
    add(
        "--http-max-receiving-bytes-per-client",
        type=int,
        default=None,
        help="the same for one client address; past it, 429 (default: what the largest body may take, about 180 "
        "MB; behind a proxy every client has the proxy's address: raise it)",
    )
    add(
        "--http-max-answer-logprobs",
        type=int,
        default=DEFAULT_MAX_ANSWER_LOGPROBS,
        help="most log-prob entries a whole (not streamed) answer may hold; a request that could exceed it is "
        f"answered 400 before it starts (default: {DEFAULT_MAX_ANSWER_LOGPROBS})",
    )
    add(
        "--http-head-timeout",
        type=float,
        default=HEAD_TIMEOUT_S,
        help="seconds an HTTP connection may take to send a complete request head; slower ones are closed "
        f"(default: {HEAD_TIMEOUT_S:g})",
    )
    add(
        "--http-keep-alive-timeout",
        type=float,
        default=KEEP_ALIVE_TIMEOUT_S,
        help=f"seconds an idle HTTP keep-alive connection stays open (default: {KEEP_ALIVE_TIMEOUT_S:g})",
    )
    add(
        "--http-max-waiting-connections",
        type=int,
        default=MAX_WAITING_CONNECTIONS,
        help="most new HTTP connections that have not sent their first request head; past it the one that waited "
        "longest is closed (connections with a request in progress, or kept alive between requests, never count; "
        "default: "
        f"{MAX_WAITING_CONNECTIONS})",
    )
    add(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSER_NAMES,
        default=None,
        help="read tool calls out of chat answers in this format (hermes: Qwen/Hermes <tool_call>{json}</tool_call>; "
        "llama3_json: Llama 3.1/3.2 JSON) into message.tool_calls; without it, chat requests that ask for tool "
        "calls are refused (default: none)",
    )
    add(
        "--trust-request-chat-template",
        action="store_true",
        help="let HTTP requests bring their own chat template (chat_template_kwargs.chat_template): a template is "
        "code the worker runs, so only when every client is trusted",
    )
    add(
        "--api-key",
        default=None,
        help="HTTP clients must send Authorization: Bearer <key> (every path but /health); a non-loopback --http "
        "needs it or --insecure (default: the ROLLOUT_API_KEY environment variable, which keeps the key out of ps)",
    )
    add("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    add("--num-blocks", type=int, default=None, help="KV blocks (default: sized from --max-memory-percent)")
    add("--max-memory-percent", type=float, default=None, help="fraction of free memory for the KV cache")
    add("--max-batch-tokens", type=int, default=2048, help="token budget per engine step (default: 2048)")
    add("--max-num-seqs", type=int, default=256, help="most sequences per engine step (default: 256)")
    add("--scheduler", choices=SCHEDULER_TYPES, default="fifo", help="scheduling policy (default: fifo)")
    add("--max-queue-size", type=int, default=0, help="most waiting requests before 'busy' (default: 0, unbounded)")
    add(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve a PEFT LoRA adapter directory unmerged under NAME (repeatable); requests choose it by name "
        "(needs pip install 'rollout[lora]'); trainers may add or replace adapters while serving",
    )
    add("--max-loras", type=int, default=4, help="most LoRA adapters served at once (default: 4)")
    add("--max-lora-rank", type=int, default=16, help="highest LoRA rank accepted (default: 16)")
    add("--cpu-offload-space", type=float, default=0.0, help="GiB of CPU swap for preempted requests (default: 0)")
    limits = WorkerLimits()
    add(
        "--client-timeout",
        type=float,
        default=limits.client_timeout_s,
        help="seconds a client with groups in flight may stay silent before they are cancelled (RolloutClient "
        f"pings every second; default: {limits.client_timeout_s:g})",
    )
    add(
        "--max-message-bytes",
        type=int,
        default=limits.max_message_bytes,
        help="largest frame accepted (larger ones drop the connection) and most data bytes per message (larger "
        f"messages are refused; keep it >= the trainers' bucket_bytes) (default: {limits.max_message_bytes})",
    )
    add("--max-prompt-len", type=int, default=None, help="longest prompt in tokens (default: the model's context)")
    add("--max-n", type=int, default=limits.max_n, help=f"most samples per group (default: {limits.max_n})")
    add(
        "--max-groups-per-client",
        type=int,
        default=limits.max_groups_per_client,
        help="most groups one client may have in flight; more are answered 'busy' (default: 0, no limit)",
    )
    add(
        "--max-pending-bytes",
        type=int,
        default=limits.max_pending_bytes,
        help="most bytes of replies kept for a client that does not read them; past it the client is dropped and "
        f"its groups cancelled (default: {limits.max_pending_bytes})",
    )
    add(
        "--max-update-phase-s",
        type=float,
        default=limits.max_update_phase_s,
        help=f"longest phase deadline (timeout_s) a weight update may ask for (default: {limits.max_update_phase_s:g})",
    )
    add(
        "--max-compile-s",
        type=float,
        default=limits.max_compile_s,
        help="seconds a structured-output constraint may take to compile (in a compile process of its own, killed "
        f"past it); slower ones are refused by name (default: {limits.max_compile_s:g})",
    )
    add(
        "--max-compile-bytes",
        type=int,
        default=limits.max_compile_bytes,
        help="memory a structured-output constraint's compile may allocate; more is refused by name (default: "
        f"{limits.max_compile_bytes})",
    )
    add(
        "--max-compiles-per-client",
        type=int,
        default=limits.max_compiles_per_client,
        help="structured-output constraints one client may have compiling or waiting to compile (clients take turns "
        f"at the compile processes); more are answered 'busy' (default: {limits.max_compiles_per_client})",
    )
    add(
        "--curve-secret-key",
        default=None,
        help="this worker's CurveZMQ key pair (a .key_secret file from rollout-keygen): encrypt every connection "
        "and accept only the keys of --authorized-keys and --trainer-keys",
    )
    add("--authorized-keys", default=None, help="directory of public keys (*.key) of clients that may generate")
    add("--trainer-keys", default=None, help="directory of public keys (*.key) of trainers that may also push weights")
    add(
        "--insecure",
        action="store_true",
        help="allow binding a non-loopback address without --curve-secret-key (anyone who can reach it may push "
        "weights)",
    )
    add(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="paged attention kernels: auto (Triton on CUDA), torch, triton (default: auto)",
    )
    add(
        "--cuda-graphs",
        choices=sorted(AUTO_ON_OFF),
        default="auto",
        help="replay CUDA graphs for decode steps: auto (on CUDA with the Triton kernels), on, off (default: auto)",
    )
    add(
        "--overlap",
        choices=sorted(AUTO_ON_OFF),
        default="auto",
        help="schedule the next step while the device runs this one: auto (on CUDA), on, off (default: auto)",
    )
    add("--fp32-logits", action="store_true", help="compute the output projection and softmax in fp32 (bf16 models)")
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
    add("--metrics-host", default="127.0.0.1", help="address the metrics server listens on (default: 127.0.0.1)")
    add("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level")
    for action in parser._actions:  # ROLLOUT_* environment variables become the defaults
        if action.option_strings and action.dest != "help":
            variable = "ROLLOUT_" + action.dest.upper()
            value = os.environ.get(variable)
            if value is not None:
                try:
                    if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001 - a flag: 1/true/yes or 0/false/no
                        if value.lower() not in ("1", "true", "yes", "0", "false", "no", ""):
                            raise ValueError(value)
                        action.default = value.lower() in ("1", "true", "yes")
                        continue
                    action.default = action.type(value) if action.type else value
                except ValueError:
                    parser.error(f"{variable}={value!r} is not a valid value for {action.option_strings[0]}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `rollout-worker`: load, bind, serve until SIGTERM/SIGINT, then abort in-flight groups."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    running = start_worker(parser, args)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: running.worker.shutdown())
    return running.serve()


if __name__ == "__main__":
    sys.exit(main())
