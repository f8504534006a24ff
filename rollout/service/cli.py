"""`rollout-worker`: serve a model over ZeroMQ for trainers.

Every option can also come from an environment variable ROLLOUT_<OPTION> (upper case, dashes as underscores, e.g.
ROLLOUT_BIND, ROLLOUT_MAX_BATCH_TOKENS); a flag given on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

import torch
import zmq

from rollout.config import ATTENTION_BACKENDS, SCHEDULER_TYPES, ContinuousBatchingConfig
from rollout.engine.manager import init_continuous_batching
from rollout.service.auth import WorkerAuth
from rollout.service.http.launch import check_http_address, start_http
from rollout.service.limits import WorkerLimits
from rollout.service.loading import load_model, load_tokenizer
from rollout.service.metrics import WorkerMetrics
from rollout.service.presets import MODEL_DTYPES, PRESETS
from rollout.service.sockets import is_loopback
from rollout.service.tracing import configure_tracing
from rollout.service.worker import RolloutWorker

logger = logging.getLogger("rollout.worker")

AUTO_ON_OFF = {"auto": None, "on": True, "off": False}


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
        f"{', '.join(PRESETS)} (default: tiny, a random Qwen3-style model built in code; sized:512 is a random "
        "model with about 512 MB of weights, for weight-transfer benchmarks)",
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
        "--trust-request-chat-template",
        action="store_true",
        help="let HTTP requests bring their own chat template (chat_template_kwargs.chat_template): a template is "
        "code the worker runs, so only when every client is trusted",
    )
    add(
        "--api-key",
        default=None,
        help="HTTP clients must send Authorization: Bearer <key> (every path but /health); a non-loopback --http "
        "needs it or --insecure",
    )
    add("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    add("--num-blocks", type=int, default=None, help="KV blocks (default: sized from --max-memory-percent)")
    add("--max-memory-percent", type=float, default=None, help="fraction of free memory for the KV cache")
    add("--max-batch-tokens", type=int, default=2048, help="token budget per engine step (default: 2048)")
    add("--max-num-seqs", type=int, default=256, help="most sequences per engine step (default: 256)")
    add("--scheduler", choices=SCHEDULER_TYPES, default="fifo", help="scheduling policy (default: fifo)")
    add("--max-queue-size", type=int, default=0, help="most waiting requests before 'busy' (default: 0, unbounded)")
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
    # Ordinary mistakes are one-line usage errors, found before the model loads.
    device = _device(parser, args)
    check_bind(parser, args.bind)
    _check_security(parser, args)
    if args.metrics_port:
        check_bind(parser, f"tcp://{args.metrics_host}:{args.metrics_port}", flag="--metrics-port")
    http_address = check_http_address(parser, args)
    try:
        limits = _limits(args)
    except ValueError as error:
        parser.error(str(error))
    if args.model.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(args.model)):
        parser.error(f"--model {args.model}: no such model directory")
    if (args.tokenizer or "").startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(args.tokenizer)):
        parser.error(f"--tokenizer {args.tokenizer}: no such tokenizer directory")
    try:
        config = _engine_config(args)
    except ValueError as error:
        parser.error(str(error))
    try:
        model = load_model(args.model, MODEL_DTYPES[args.dtype], device)
    except (ValueError, OSError) as error:
        parser.error(f"--model {args.model}: {error}")
    try:
        tokenizer, tokenizer_name = load_tokenizer(args.model, args.tokenizer)
    except (ValueError, OSError) as error:
        parser.error(f"--tokenizer {args.tokenizer}: {error}")
    try:
        manager = init_continuous_batching(model, continuous_batching_config=config, tokenizer=tokenizer)
    except ValueError as error:  # e.g. a kernel backend this machine cannot run
        parser.error(str(error))
    manager.warmup()  # kernels compiled and decode CUDA graphs captured before the first client arrives
    auth = None
    if args.curve_secret_key is not None:
        try:
            auth = WorkerAuth(zmq.Context(), args.curve_secret_key, args.authorized_keys, args.trainer_keys)
        except ValueError as error:
            parser.error(f"--curve-secret-key: {error}")
    elif args.insecure and not is_loopback(args.bind):
        logger.warning("--insecure: %s accepts anyone who can reach it, weight updates included", args.bind)
    worker = RolloutWorker(
        manager,
        args.bind,
        args.model,
        limits=limits,
        keep_staging=not args.release_staging,
        auth=auth,
        check_finite=args.check_finite,
        tokenizer_name=tokenizer_name,
    )
    metrics = None
    if args.metrics_port is not None:
        metrics = WorkerMetrics(worker.stats)
        manager.step_observer = metrics.observe_step
        try:
            port = metrics.serve(args.metrics_port, args.metrics_host)
        except OSError as error:
            parser.error(f"--metrics-port {args.metrics_port}: cannot listen ({error})")
        logger.info("metrics at http://%s:%d/metrics", args.metrics_host, port)
    http = None
    if http_address is not None:
        http = start_http(parser, args, http_address, manager, worker, tokenizer, limits)
    if configure_tracing():
        logger.info("exporting OpenTelemetry traces (OTEL_* environment variables)")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: worker.shutdown())
    logger.info(
        "rollout-worker ready on %s: model %s on %s (%s), %d KV blocks of %d tokens",
        worker.address,
        args.model,
        device,
        next(model.parameters()).dtype,
        manager.engine.num_blocks,
        config.block_size,
    )
    try:
        worker.serve()
    finally:
        if http is not None:
            http.stop()
    if metrics is not None:
        metrics.close()
    if manager.error is not None:  # the engine thread failed: a supervisor should restart this worker
        logger.error("rollout-worker stopped: the engine failed (%r)", manager.error)
        return 1
    logger.info("rollout-worker stopped")
    return 0


def _device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """The serving device, or a usage error naming the flag (CUDA asked of a torch that has none, a bad name)."""
    flag = f"--gpu {args.gpu}" if args.gpu is not None else f"--device {args.device}"
    try:
        device = torch.device(f"cuda:{args.gpu}" if args.gpu is not None else (args.device or "cpu"))
    except RuntimeError as error:
        parser.error(f"{flag}: {error}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            parser.error(f"{flag}: torch {torch.__version__} ({build}) sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(f"{flag}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


def check_bind(parser: argparse.ArgumentParser, address: str, flag: str = "--bind") -> None:
    """A usage error when the address is malformed, or is a TCP port already in use, before the model loads."""
    from rollout.service.sockets import check_address

    problem = check_address(address)
    if problem is not None:
        parser.error(f"{flag} {problem}")
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or port == "*":
        return
    probe = socket.socket(socket.AF_INET6 if host.startswith("[") else socket.AF_INET)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds: TIME_WAIT is no conflict
    try:
        probe.bind(("" if host in ("*", "") else host.strip("[]"), int(port)))
    except (OSError, ValueError) as error:
        parser.error(f"{flag} {address}: cannot bind ({error})")
    finally:
        probe.close()


def _check_security(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Keys must come together, and a non-loopback address needs them (or --insecure)."""
    if args.curve_secret_key is None:
        if args.authorized_keys or args.trainer_keys:
            parser.error("--authorized-keys/--trainer-keys need --curve-secret-key (the worker's own key pair)")
        if not args.insecure and not is_loopback(args.bind):
            parser.error(
                f"--bind {args.bind}: a non-loopback address needs authentication (--curve-secret-key with "
                "--authorized-keys/--trainer-keys; make keys with rollout-keygen), or --insecure to accept anyone"
            )
        return
    if not args.authorized_keys and not args.trainer_keys:
        parser.error("--curve-secret-key needs --authorized-keys and/or --trainer-keys (whom to accept)")
    for flag, path in (("--authorized-keys", args.authorized_keys), ("--trainer-keys", args.trainer_keys)):
        if path is not None and not os.path.isdir(path):
            parser.error(f"{flag} {path}: no such directory")
    if not os.path.isfile(args.curve_secret_key):
        parser.error(f"--curve-secret-key {args.curve_secret_key}: no such file (make one with rollout-keygen)")


def _limits(args: argparse.Namespace) -> WorkerLimits:
    """The per-client limits the flags give (a FieldError names a bad one)."""
    return WorkerLimits(
        max_message_bytes=args.max_message_bytes,
        max_prompt_len=args.max_prompt_len,
        max_n=args.max_n,
        max_groups_per_client=args.max_groups_per_client,
        max_pending_bytes=args.max_pending_bytes,
        max_update_phase_s=args.max_update_phase_s,
        client_timeout_s=args.client_timeout,
    )


def _engine_config(args: argparse.Namespace) -> ContinuousBatchingConfig:
    """The engine settings the flags give (a FieldError names a bad one)."""
    return ContinuousBatchingConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_memory_percent=args.max_memory_percent,
        max_batch_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        scheduler_type=args.scheduler,
        max_queue_size=args.max_queue_size,
        cpu_offload_space=args.cpu_offload_space,
        attention_backend=args.attention_backend,
        fp32_logits=args.fp32_logits,
        use_cuda_graph=AUTO_ON_OFF[args.cuda_graphs],
        overlap_scheduling=AUTO_ON_OFF[args.overlap],
    )


if __name__ == "__main__":
    sys.exit(main())
