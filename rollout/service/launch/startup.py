"""Building a rollout worker from `rollout-worker`'s parsed flags: every ordinary mistake a one-line usage error
found before the model loads, then the model, engine, sockets and optional HTTP / metrics servers. `cli.main` serves
what `start_worker` builds until a signal; `rollout.ray` serves it inside a Ray actor.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from rollout.cli.extras import MissingExtra, require_extra
from rollout.cli.hub import HubUnreachable
from rollout.cli.parser import CliParser
from rollout.config import ContinuousBatchingConfig
from rollout.engine.manager.continuous_batching import ContinuousBatchingManager, init_continuous_batching
from rollout.presets.models import MODEL_DTYPES
from rollout.protocol.auth import WorkerAuth, WorkerKeys
from rollout.protocol.sockets import is_loopback
from rollout.service.address_checks import check_bind, check_metrics_address
from rollout.service.http.serving.launch import check_http_address, start_http
from rollout.service.launch.cache_capacity import cache_capacity
from rollout.service.launch.flags import check_cuda_only_flags, check_settings, lora_specs, served_model_name
from rollout.service.launch.loading import load_model, load_tokenizer, torch_device
from rollout.service.launch.preload_checks import check_before_load, check_context, model_context_of
from rollout.service.launch.start_adapters import serve_start_adapters
from rollout.service.observability.metrics import WorkerMetrics
from rollout.service.observability.tracing import configure_tracing
from rollout.service.zmq.limits import WorkerLimits
from rollout.service.zmq.worker import RolloutWorker

logger = logging.getLogger("rollout.worker")


@dataclass
class RunningWorker:
    """A built worker: its ZeroMQ server, engine manager, model and optional HTTP / metrics servers."""

    worker: RolloutWorker
    manager: ContinuousBatchingManager
    model: torch.nn.Module
    http: Any = None  # rollout.service.http.serving.server.HttpServer, with --http
    metrics: WorkerMetrics | None = None
    ready: tuple[str, ...] = ()  # logged once the engine runs: /health answers "ok" from then on

    def serve(self) -> int:
        """Serve until `worker.shutdown()` (a signal, or the engine failing); then stop the other servers. Returns the
        exit status: 1 when the engine failed (a supervisor should restart the worker), else 0."""
        # A full garbage collection holds the interpreter lock while it walks every tracked object: the ~400,000 that
        # torch, transformers and the model leave at start took 0.5 s, a stall of every client whenever a request's
        # allocations set one off. Frozen while serving, they are never walked (as vLLM does after its start);
        # unfrozen after, so that the process's exit frees them (native libraries report what was never freed).
        gc.collect()
        gc.freeze()
        try:
            self.manager.start()  # before "ready": a client that reads it finds the engine running
            for line in self.ready:
                logger.info(line)
            self.worker.serve()
        finally:
            gc.unfreeze()
            if self.http is not None:
                self.http.stop()
        if self.metrics is not None:
            self.metrics.close()
        if self.manager.error is not None:
            logger.error("rollout-worker stopped: the engine failed (%r)", self.manager.error)
            return 1
        logger.info("rollout-worker stopped")
        return 0


def start_worker(
    parser: CliParser, args: argparse.Namespace, keys_read: Callable[[], None] | None = None
) -> RunningWorker:
    """Check the flags, read the key files, load the model and tokenizer, warm the engine up and bind the sockets
    (serving starts with `RunningWorker.serve`).

    Args:
        parser: rollout-worker's parser (`cli.build_parser`); its `error` reports every usage error.
        args: the parsed flags.
        keys_read: called once the key files were read, before the model loads (a Ray fleet's actor deletes its key
            files then: an actor killed while it loads leaves no secret key on disk).
    """
    device, http_address, limits, config = check_flags(parser, args)
    keys = None
    if args.curve_secret_key is not None:  # read before the model loads: a bad key fails fast
        try:
            keys = WorkerKeys.read(args.curve_secret_key, args.authorized_keys, args.trainer_keys)
        except ValueError as error:  # the message names the flag whose file it is
            parser.error(str(error) if str(error).startswith("--") else f"--curve-secret-key: {error}")
        warn_open_secret(args.curve_secret_key)
    if keys_read is not None:
        keys_read()
    check_before_load(parser, args, config)  # what the model's config and the adapters' configs tell
    if args.tokenizer is not None:  # a --tokenizer of its own: seconds to load, so a bad one is found before the model
        tokenizer, tokenizer_name = _tokenizer(parser, args)
    try:
        model = load_model(args.model, MODEL_DTYPES[args.dtype], device)
    except HubUnreachable as error:  # names --model itself, and says what to do
        parser.error(str(error))
    except (ValueError, OSError) as error:
        parser.error(f"--model {args.model}: {error}")
    if args.tokenizer is None:  # the model's own (after it: a model that cannot load is the news)
        tokenizer, tokenizer_name = _tokenizer(parser, args)
    try:
        manager = init_continuous_batching(model, continuous_batching_config=config, tokenizer=tokenizer)
    except ValueError as error:  # e.g. a kernel backend this machine cannot run, a cache that holds no block
        parser.error(parser.flag_message(error))
    try:  # a start that fails from here (a usage error is SystemExit) releases what it built: in-process (a Ray
        # actor, a test) nothing else would, and a GPU's engine holds most of its memory
        worker, metrics, http = _serve_parts(
            parser, args, manager, keys, limits, http_address, tokenizer, tokenizer_name
        )
    except BaseException:
        manager.destroy()
        raise
    if configure_tracing():
        logger.info("exporting OpenTelemetry traces (OTEL_* environment variables)")
    ready = (
        f"rollout-worker ready on {worker.address}: model {args.model}{_served_as(args)} on {device} ({next(model.parameters()).dtype}), "
        f"{manager.engine.num_blocks} KV blocks of {config.block_size} tokens",
        cache_capacity(manager.engine.num_blocks, config.block_size, manager.engine.max_model_len),
    )
    return RunningWorker(worker, manager, model, http, metrics, ready)


def _tokenizer(parser: CliParser, args: argparse.Namespace) -> tuple[Any, str | None]:
    """`load_tokenizer` for the flags, a usage error naming --tokenizer when it cannot be loaded."""
    try:
        return load_tokenizer(args.model, args.tokenizer)
    except HubUnreachable as error:  # names the flag itself (--tokenizer, or --model for the model's own)
        parser.error(str(error))
    except (ValueError, OSError) as error:
        parser.error(f"--tokenizer {args.tokenizer}: {error}")


def _served_as(args: argparse.Namespace) -> str:
    """The ready line's note of the served name, when --served-model-name gives one."""
    return f" (served as {args.served_model_name})" if args.served_model_name else ""


def _serve_parts(
    parser: CliParser,
    args: argparse.Namespace,
    manager: ContinuousBatchingManager,
    keys: WorkerKeys | None,
    limits: WorkerLimits,
    http_address: tuple[str, int] | None,
    tokenizer: Any,
    tokenizer_name: str | None,
) -> tuple[RolloutWorker, WorkerMetrics | None, Any]:
    """Load the start adapters, warm the engine up, then bind the worker's socket and start the metrics and HTTP
    servers; a failure (a usage error: SystemExit) closes those already started, and the caller the manager."""
    serve_start_adapters(parser, args.lora, manager.engine, served_model_name(args))
    # (a built-in model, or a config found only by loading: not checked before; a longer prompt would be capped there)
    context = model_context_of(manager.engine.model) or (None if args.max_model_len else manager.engine.max_model_len)
    check_context(parser, args, args.max_model_len, context, model_context_of(manager.engine.model, rope_scaled=True))
    try:
        manager.warmup()  # kernels compiled and decode CUDA graphs captured before the first client arrives
    except RuntimeError as error:  # the model's forward fails: no request could be served
        parser.error(f"--model {args.model}: {error}")
    auth = None
    if keys is not None:
        auth = WorkerAuth(zmq.Context(), keys)
    elif args.insecure and not is_loopback(args.bind):
        logger.warning("--insecure: %s accepts anyone who can reach it, weight updates included", args.bind)
    try:
        worker = RolloutWorker(
            manager,
            args.bind,
            served_model_name(args),
            limits=limits,
            keep_staging=not args.release_staging,
            auth=auth,
            check_finite=args.check_finite,
            tokenizer_name=tokenizer_name,
        )
    except zmq.ZMQError as error:  # (the worker closed what it opened) e.g. the port was taken since it was probed,
        # or an ipc:// path in a missing directory: a usage error naming the flag, not a traceback
        parser.error(f"--bind {args.bind}: cannot bind ({error.strerror})")
    metrics = None
    try:
        worker.compiles.start(server=args.preload_compiles)  # else the first new spec starts the compile processes
        if args.metrics_port is not None:
            # The worker is held weakly: the manager holds the metrics (its step observer), and a bound `worker.stats`
            # would close the cycle manager -> metrics -> worker -> manager, which only a garbage collection frees.
            served = weakref.proxy(worker)
            metrics = WorkerMetrics(lambda: served.stats())
            manager.step_observer = metrics.observe_step
            try:
                port = metrics.serve(args.metrics_port, args.metrics_host)
            except OSError as error:
                parser.error(f"--metrics-port {args.metrics_port}: cannot listen ({error})")
            host = f"[{args.metrics_host}]" if ":" in args.metrics_host else args.metrics_host  # an IPv6 address
            logger.info("metrics at http://%s:%d/metrics", host, port)
        http = None
        if http_address is not None:
            observe = metrics.observe_http if metrics is not None else None
            http = start_http(parser, args, http_address, manager, worker, tokenizer, limits, observe)
    except BaseException:  # the metrics read the worker, whose compile processes and socket go with this start
        if metrics is not None:
            metrics.close()
        worker.close()
        raise
    return worker, metrics, http


def check_flags(
    parser: CliParser, args: argparse.Namespace
) -> tuple[torch.device, tuple[str, int] | None, WorkerLimits, ContinuousBatchingConfig]:
    """Every check of the flags that needs no model: ordinary mistakes are one-line usage errors (`parser.error`,
    exit status 2), found before the model loads. Binds nothing (ports are probed and released).

    Args:
        parser: rollout-worker's parser.
        args: the parsed flags.
    Returns:
        The serving device, the HTTP address (None without --http), the per-client limits and the engine settings.
    """
    device = _device(parser, args)
    if device.type != "cuda":  # found before the model loads, in the flags' own words
        check_cuda_only_flags(parser, args, str(device))
    check_bind(parser, args.bind)
    _check_security(parser, args)
    check_metrics_address(parser, args)
    http_address = check_http_address(parser, args)
    _check_distinct_ports(parser, args, http_address)
    limits, config = check_settings(parser, args)
    if args.lora:
        try:  # PEFT loads the adapter directories after the model: its absence is found now
            require_extra("lora", f"--lora {args.lora[0]}")
        except MissingExtra as error:
            parser.error(str(error))
        lora_specs(parser, args.lora, served_model_name(args))
    if args.max_memory_percent is not None and args.max_memory_percent <= 1:
        logger.warning(
            "--max-memory-percent %g gives the KV cache %g%% of free memory (it takes a percent: 90 means 90%%)",
            args.max_memory_percent,
            args.max_memory_percent,
        )
    return device, http_address, limits, config


def _device(parser: CliParser, args: argparse.Namespace) -> torch.device:
    """The serving device, or a usage error naming the flag (CUDA asked of a torch that has none, a bad name).

    --gpu and --device exclude each other. A ROLLOUT_GPU or ROLLOUT_DEVICE variable only sets its flag's default,
    so the flag typed on the command line wins over the other's variable; both variables set, and neither flag
    typed, is a usage error naming them.
    """
    if parser.typed("--device") and parser.typed("--gpu"):
        # (argparse's own check misses it when --gpu's value is the one ROLLOUT_GPU set: it sees no change)
        parser.error("--gpu and --device exclude each other: give one")
    if parser.typed("--device"):
        args.gpu = None
    elif parser.typed("--gpu"):
        args.device = None
    elif args.gpu is not None and args.device is not None:
        parser.error("ROLLOUT_GPU and ROLLOUT_DEVICE are both set: unset one, or give --gpu or --device")
    flag = f"--gpu {args.gpu}" if args.gpu is not None else f"--device {args.device}"
    if args.gpu is not None and args.gpu < 0:
        parser.error(f"--gpu {args.gpu}: a CUDA device index is 0 or more (nvidia-smi lists them)")
    try:
        return torch_device(f"cuda:{args.gpu}" if args.gpu is not None else (args.device or "cpu"), flag)
    except ValueError as error:
        parser.error(str(error))


_ANY_HOST = ("", "*", "0.0.0.0", "::")


def _check_distinct_ports(
    parser: argparse.ArgumentParser, args: argparse.Namespace, http_address: tuple[str, int] | None
) -> None:
    """A usage error when two of --bind, --http and --metrics-port ask for one TCP port on one host: each port is
    free when probed alone, so the second bind would fail only once the model has loaded."""
    taken: list[tuple[str, str, int]] = []  # (flag and value, host, port)
    if args.bind.startswith("tcp://"):
        host, _, port = args.bind.removeprefix("tcp://").rpartition(":")
        if port.isdigit():
            taken.append((f"--bind {args.bind}", host.strip("[]"), int(port)))
    if http_address is not None and http_address[1]:
        taken.append((f"--http {args.http}", http_address[0], http_address[1]))
    if args.metrics_port:
        taken.append((f"--metrics-port {args.metrics_port}", args.metrics_host, args.metrics_port))
    for index, (flag, host, port) in enumerate(taken):
        for other, other_host, other_port in taken[:index]:
            if port == other_port and (host == other_host or host in _ANY_HOST or other_host in _ANY_HOST):
                parser.error(f"{flag}: port {port} is also {other}'s; give each its own port (0 picks a free one)")


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


def warn_open_secret(path: str) -> None:
    """Warn when the worker's secret key file is readable or writable by other users (rollout-keygen writes it 0600):
    whoever reads it can pose as this worker to its clients."""
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        logger.warning(
            "--curve-secret-key %s: other users may read or change it (mode %04o): whoever reads it can pose as this "
            "worker; chmod 600 it",
            path,
            mode,
        )
