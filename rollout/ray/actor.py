"""One rollout worker inside a Ray actor: the same worker `rollout-worker` builds (`rollout.service.launch.startup`), bound to
its node's address with the fleet's keys, served on a thread of the actor's process. The worker lives and dies with
the actor: when it stops by itself (its engine failed), the actor exits so that Ray restarts it; killing the actor
leaves nothing behind.

The actor also copies its weights to another worker (`copy_weights_to`): the peer weight copy that brings a restarted
or added worker up to the fleet's newest version, as a weight transaction from this worker's model (the same
staging, checks and commit as a trainer's push).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from rollout.ray.keys import FleetKeys

logger = logging.getLogger("rollout.ray")

# Flags the fleet sets itself: worker_args may not give them.
FLEET_FLAGS = (
    "--bind",
    "--curve-secret-key",
    "--authorized-keys",
    "--trainer-keys",
    "--insecure",
    "--model",
    "--http",
    "--api-key",
)


def worker_argv(argv: list[str], host: str, files: Any, http: bool, api_key: str | None) -> list[str]:
    """The worker's command line on this node: `argv`, bound to the node's address, with the fleet's CurveZMQ key
    files and, with `http`, the OpenAI API on a free port of the node and its key.

    Args:
        argv: the fleet's worker arguments.
        host: this node's IP address.
        files: the key files (`worker_secret`, `trainer_keys`).
        http: also serve the OpenAI API.
        api_key: its key (passed as `--api-key=KEY`: a random key may begin with "-").
    """
    bracketed = f"[{host}]" if ":" in host else host
    argv = [*argv, "--bind", f"tcp://{bracketed}:*", "--curve-secret-key", files.worker_secret]
    argv += ["--trainer-keys", files.trainer_keys]
    if http:
        argv += ["--http", f"{bracketed}:0", f"--api-key={api_key or ''}"]
    return argv


# The control routes' flags: (flag, dest, value when not given).
_CONTROL_FLAGS = (
    ("--enable-control-routes", "enable_control_routes", False),
    ("--enable-tokenizer-info-endpoint", "enable_tokenizer_info_endpoint", False),
    ("--control-api-key", "control_api_key", None),
    ("--control-allowed-dirs", "control_allowed_dirs", []),
)


class _UsageError(ValueError):
    """A bad `rollout-worker` flag, raised instead of exiting the process."""


def worker_parser() -> argparse.ArgumentParser:
    """`rollout-worker`'s parser, raising `ValueError` on a usage error instead of exiting."""
    from rollout.service.launch.cli import build_parser

    parser = build_parser()
    parser.allow_abbrev = False  # "--mod" must not pass for --model, a flag the fleet sets
    # The flags the fleet sets take no ROLLOUT_* variable of the driver's or a node's environment (ROLLOUT_API_KEY,
    # kept for workers started by hand, failed every worker of a fleet without http as an --api-key without --http).
    parser.set_defaults(
        model="tiny",
        bind=None,
        http=None,
        api_key=None,
        curve_secret_key=None,
        authorized_keys=None,
        trainer_keys=None,
        insecure=False,
    )

    def refuse(message: str) -> None:
        raise _UsageError(message)

    parser.error = refuse  # type: ignore[method-assign]
    return parser


def check_worker_args(worker_args: list[str], http: bool = False) -> None:
    """Refuse, naming it, a `worker_args` entry the fleet sets itself or `rollout-worker` would refuse: a flag it
    does not know, a bad setting (`--max-n 0`), an HTTP API or control-route flag without `http` (it would do
    nothing, or fail every worker's start). Checks that need the worker's node (ports, directories, the device) are
    left to the worker.

    Args:
        worker_args: `RolloutFleet.launch`'s.
        http: whether the fleet serves the OpenAI API.
    Raises:
        ValueError: starting with "worker_args".
    """
    if not isinstance(worker_args, (list, tuple)) or not all(isinstance(arg, str) for arg in worker_args):
        raise ValueError(f"worker_args: a list of rollout-worker command-line arguments (strings), got {worker_args!r}")
    for arg in worker_args:
        flag = arg.split("=", 1)[0]
        if flag in FLEET_FLAGS:
            raise ValueError(f"worker_args: {flag} is set by the fleet (use RolloutFleet.launch's own arguments)")
        if flag in ("-h", "--help"):  # argparse would print the whole help here and exit
            raise ValueError(f"worker_args: {flag} is not a worker setting (rollout-worker --help lists them)")
    from rollout.service.http.control.flags import check_control_flags
    from rollout.service.launch.flags import check_http_only_flags, engine_config, worker_limits

    parser = worker_parser()
    try:
        args = parser.parse_args([*worker_args, "--bind", "tcp://127.0.0.1:*", *(["--http", "127.0.0.1:0"] * http)])
        check_http_only_flags(parser, args)
        # The driver's ROLLOUT_* variables are not the nodes': only the control flags worker_args give are checked.
        for flag, dest, unset in _CONTROL_FLAGS:
            if not parser.typed(flag):
                setattr(args, dest, unset)
        check_control_flags(parser, args, on_this_host=False)
        if args.metrics_host is not None and args.metrics_port is None:
            raise _UsageError(f"--metrics-host {args.metrics_host}: has no effect without --metrics-port")
        worker_limits(args)
        engine_config(args)
    except _UsageError as error:
        hint = "; RolloutFleet.launch(..., http=True) gives each worker one" if "--http HOST:PORT" in str(error) else ""
        raise ValueError(f"worker_args: {error}{hint}") from None
    except ValueError as error:  # a FieldError of the limits or the engine settings: named by its flag
        raise ValueError(f"worker_args: {parser.flag_message(error)}") from None
    except SystemExit as error:  # (argparse's other exits)
        raise ValueError(f"worker_args: {error}") from None


class RolloutWorkerActor:
    """The Ray actor class (`RolloutFleet` makes it remote with the placement and restart options)."""

    def __init__(self, argv: list[str], keys: FleetKeys, http: bool, api_key: str | None):
        """Build and start the worker.

        Args:
            argv: `rollout-worker` arguments (model, device, engine flags), without the address or keys.
            keys: the fleet's keys.
            http: also serve the OpenAI API on this node's address (a free port, `api_key` required).
            api_key: the HTTP API key.
        """

        # The worker's modules (torch, transformers: seconds) are imported before the keys are written, which then
        # lie on disk only while the flags are parsed and the keys read: an actor killed in its imports left them.
        import rollout.service.launch.cli  # noqa: F401
        import rollout.service.launch.startup  # noqa: F401
        from rollout.protocol.auth import load_key_pair, load_public_key

        self.started_at = time.time()
        # The certificates exist on disk only until the worker has read them, before its model loads (it keeps them
        # in memory): an actor killed while it loads (a restart, a launch's ready_timeout) leaves none behind.
        key_dir = tempfile.mkdtemp(prefix="rollout-worker-keys-")
        try:
            files = keys.write(key_dir)
            self._trainer_secret = load_key_pair(files.trainer_secret)[1]
            self._worker_public = load_public_key(files.worker_secret)
            self._running = self._start(argv, files, http, api_key, lambda: shutil.rmtree(key_dir, ignore_errors=True))
        finally:
            shutil.rmtree(key_dir, ignore_errors=True)
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="rollout-worker-serve", daemon=True)
        self._thread.start()

    @staticmethod
    def _start(argv: list[str], files: Any, http: bool, api_key: str | None, keys_read: Callable[[], None]) -> Any:
        import ray

        from rollout.service.launch.startup import start_worker

        parser = worker_parser()
        args = parser.parse_args(worker_argv(argv, ray.util.get_node_ip_address(), files, http, api_key))
        logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return start_worker(parser, args, keys_read)

    def _serve(self) -> None:
        status = 1
        try:
            status = self._running.serve()
        except BaseException:
            logger.exception("rollout worker's serving loop failed")
            raise
        finally:
            if not self._stopping:  # the engine failed (or serving raised): end the process for Ray to restart it
                logger.error(
                    "rollout worker stopped by itself (status %d); ending the actor for Ray to restart it", status
                )
                os._exit(1)

    def info(self) -> dict[str, Any]:
        """The worker's address, served version, HTTP URL (or None), process id and start time."""
        http = self._running.http
        return {
            "address": self._running.worker.address,
            "version": self._running.worker.policy_version,
            "http": None if http is None else http.url,
            "pid": os.getpid(),
            "started_at": self.started_at,
        }

    def copy_weights_to(self, address: str, timeout: float = 120.0) -> int:
        """Copy this worker's weights (base and LoRA adapters, `weight_copy.py`), with their versions, to the worker
        at `address` (one of the fleet: it accepts the fleet's trainer key). Returns the version copied; 0 copies
        nothing (every worker starts with the model's own weights, version 0).

        The copy is read from the live model while this worker serves; a weight update committed here meanwhile
        would mix two versions, so the copy is made again until this worker's version stayed the same throughout.

        Raises:
            RuntimeError: the version kept changing over three copies, or the copy failed (naming why).
        """
        from rollout.ray.weight_copy import copy_weights
        from trainer_bridge.client import RolloutClient

        worker = self._running.worker
        for _ in range(3):
            if worker.policy_version == 0:
                return 0
            with RolloutClient(
                [address],
                timeout=timeout,
                connect_timeout=timeout,
                curve_secret_key=self._trainer_secret,
                server_public_key=self._worker_public,
            ) as client:
                try:
                    version = copy_weights(worker, self._running.model, client, timeout)
                except Exception as error:  # noqa: BLE001 - named for the fleet, which tries another peer
                    raise RuntimeError(f"copying weights to {address} failed: {error}") from None
            if worker.policy_version == version:
                return version
        raise RuntimeError(f"this worker's weights changed during each of three copies to {address}")

    def shutdown(self) -> None:
        """Stop serving (in-flight groups are aborted) and wait for the worker to stop."""
        self._stopping = True
        self._running.worker.shutdown()
        self._thread.join(60)
