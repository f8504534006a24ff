"""The workers under load: `WorkerProcess` (a `rollout-worker` subprocess on a free loopback port, its output in a
log file), and its `stats` over a raw socket (`worker_stats`, `blocks_used`)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from typing import Any

from rollout.benchmarks.harness.worker_probe import free_port, wait_answering, worker_command


class WorkerProcess:
    """A `rollout-worker` subprocess on a free loopback port, its output in a log file (never a pipe nobody reads:
    a worker that logs a lot would block on it)."""

    def __init__(self, flags: list[str] = (), log_dir: str | None = None, name: str = "worker"):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.log_path = os.path.join(log_dir or tempfile.gettempdir(), f"{name}-{os.getpid()}-{time.time_ns()}.log")
        command = worker_command(self.address, flags)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed by stop()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        self.killed = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Ping until the worker answers; a worker that exits first is an error naming its log."""
        try:
            wait_answering(self.address, timeout_s, lambda: None if self.alive() else self.log_tail())
        except TimeoutError as error:
            raise TimeoutError(f"{error}: {self.log_tail()}") from None

    def kill(self) -> None:
        self.killed = True
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL; returns the exit status."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def log_tail(self, size: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, os.path.getsize(self.log_path) - size))
                return log.read().decode(errors="replace")
        except OSError:
            return ""


def worker_stats(address: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """The worker's `stats` counters over a raw socket (None when it does not answer)."""
    import zmq

    from rollout import protocol as p

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(p.encode(p.Stats()))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        reply = p.decode(sock.recv_multipart())
        return reply.stats if isinstance(reply, p.StatsReply) else None
    finally:
        sock.close()
        context.term()


def blocks_used(stats: dict[str, Any] | None) -> int | None:
    """KV blocks in use according to a worker's stats."""
    if stats is None:
        return None
    if "kv_blocks_used" in stats:
        return stats["kv_blocks_used"]
    named = [value for key, value in stats.items() if "blocks_used" in key and isinstance(value, int)]
    return named[0] if named else None
