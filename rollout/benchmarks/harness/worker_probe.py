"""A benchmark's `rollout-worker` subprocess: its command line on a free loopback port, waiting until it answers,
and stopping it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_command(address: str, flags: Sequence[str] = (), device: str = "cpu") -> list[str]:
    """The command line of a `rollout-worker` serving the tiny preset at `address`, logging warnings only.

    Args:
        address: the ZeroMQ address it binds ("tcp://127.0.0.1:PORT", see `free_port`).
        flags: more `rollout-worker` flags (e.g. ["--num-blocks", "512"]).
        device: the torch device it runs on.
    """
    command = [sys.executable, "-m", "rollout.service.launch.cli", "--model", "tiny", "--device", device]
    return command + ["--bind", address, "--log-level", "WARNING", *flags]


def wait_answering(address: str, timeout_s: float, exited: Callable[[], str | None] = lambda: None) -> None:
    """Ping the worker at `address` until it answers (before any client starts counting heartbeats).

    Args:
        address: the worker's ZeroMQ address.
        timeout_s: most seconds to wait.
        exited: why the worker process is gone, or None while it runs: checked between pings.
    Raises:
        RuntimeError: the worker exited first (with `exited()`'s words). TimeoutError: no answer in time.
    """
    import zmq

    from rollout import protocol as p

    context = zmq.Context()
    probe = context.socket(zmq.DEALER)
    probe.setsockopt(zmq.LINGER, 0)
    probe.connect(address)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            gone = exited()
            if gone is not None:
                raise RuntimeError(f"the rollout-worker on {address} exited: {gone}")
            probe.send_multipart(p.encode(p.Ping(0)))
            if probe.poll(500):
                return
        raise TimeoutError(f"no rollout-worker answered on {address}")
    finally:
        probe.close()
        context.term()


def stop_worker(process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Stop a worker subprocess: SIGTERM (it aborts its groups and frees its cache), then SIGKILL after `timeout_s`."""
    stop_workers([process], timeout_s)


def stop_workers(processes: list[subprocess.Popen], timeout_s: float = 60.0) -> None:
    """Stop worker subprocesses together: SIGTERM to each, then SIGKILL to those still running after `timeout_s` (a
    worker that ignores SIGTERM never outlives the benchmark, nor hides its error behind a `TimeoutExpired`).

    Args:
        processes: the workers.
        timeout_s: seconds they have, together, to stop on SIGTERM.
    """
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
