"""A process that has imported what a `rollout-worker` imports (torch, transformers, the engine, the service, xgrammar,
the HTTP stack) and forks a worker per request, so a test's worker starts in about a second instead of importing for
eight (the suite starts about 30). The forked child runs the real `rollout.service.launch.cli.main` with the test's
flags, environment and working directory, its output in the test's log file, and exits as a `python -m
rollout.service.launch.cli` process would: the same exit status, its threads joined and its exit hooks run.

Forking after these imports is safe: the zygote never runs a torch operator, opens a ZeroMQ context or starts a thread
of its own (torch's import starts one idle helper thread, as in every torch process that forks DataLoader workers).

`Zygote` is the test side (tests/service_helpers.Worker uses it): it starts this script once, asks it for workers, and
gives each a `ForkedProcess` handle with `subprocess.Popen`'s methods. The zygote is the workers' parent, so it reaps
them and writes each exit status to a file named by the pid, which the handle reads.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What a worker imports on its way to serving (its flags decide which: --http, --lora, structured outputs, MoE).
PRELOAD = (
    "rollout.service.launch.cli",
    "rollout.service.launch.startup",
    "rollout.presets.models",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "xgrammar",
    "peft",
    "fastapi",
    "uvicorn",
    "rollout.service.http.serving.launch",
)


# Variables a worker's environment may set differently from the zygote's: the child gets the test's values. pytest
# sets PYTEST_CURRENT_TEST per test; ROLLOUT_* are read when the flags parse (defaults, the API key); torch read
# OMP_NUM_THREADS when it loaded, so a child whose value differs sets its thread count from it. Any other difference
# could have changed an import (TRITON_*, ...): such a worker is started as a plain subprocess instead.
def _per_worker(variable: str) -> bool:
    return variable in ("PYTEST_CURRENT_TEST", "OMP_NUM_THREADS") or variable.startswith("ROLLOUT_")


# ---- the zygote process -------------------------------------------------------------------------------------------


def _reap(status_dir: Path) -> None:
    """Record the exit status of every child that ended (Popen's convention: -N when killed by signal N)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        partial = status_dir / f"{pid}.part"
        partial.write_text(str(os.waitstatus_to_exitcode(status)))
        partial.rename(status_dir / str(pid))


def _become_worker(request: dict, wakeup_fds: tuple[int, int]) -> None:
    """In the forked child: take the test's log, environment, directory and flags (then return, to run the worker)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in wakeup_fds:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)  # also drops the zygote's reply pipe
    os.dup2(log, 2)
    os.close(log)
    os.chdir(request["cwd"])
    threads = request["env"].get("OMP_NUM_THREADS")
    if threads != os.environ.get("OMP_NUM_THREADS") and threads:
        import torch

        torch.set_num_threads(int(threads))
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["argv0"], *request["argv"]]


def serve(status_dir: Path) -> dict | None:
    """Fork a worker per request line on stdin, answering each with its pid; reap them as they end. Returns None at
    stdin's end (in the zygote), or the request (in a forked child, which then runs the worker)."""
    sys.path[0] = os.getcwd()  # what `python -m` puts first, not this script's folder
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an extra this environment lacks: the worker imports (or refuses) it itself
            pass
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, not SIG_IGN: ignoring it would discard the statuses
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_read], [], [])
        if wake_read in readable:
            while True:
                try:
                    if not os.read(wake_read, 512):
                        break
                except BlockingIOError:
                    break
            _reap(status_dir)
        if 0 not in readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _become_worker(request, (wake_read, wake_write))
                return request
            os.write(1, json.dumps({"pid": pid}).encode() + b"\n")


# ---- the test side ------------------------------------------------------------------------------------------------


class ForkedProcess:
    """A worker forked by the zygote, with the part of `subprocess.Popen`'s interface the tests use."""

    def __init__(self, pid: int, args: list[str], status_file: Path) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._status_file = status_file

    def poll(self) -> int | None:
        if self.returncode is None and self._status_file.exists():
            self.returncode = int(self._status_file.read_text())
            self._status_file.unlink()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not yet reaped, so the pid is still this worker's
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote process of this test session (started on first use, stopped by `close`)."""

    def __init__(self) -> None:
        self.status_dir = Path(tempfile.mkdtemp(prefix="worker_zygote_"))
        self.environment = dict(os.environ)
        self.cwd = os.getcwd()
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(self.status_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )

    def can_fork(self) -> bool:
        """Whether a worker started now would see what the zygote imported under (environment and directory)."""
        now = {key: value for key, value in os.environ.items() if not _per_worker(key)}
        then = {key: value for key, value in self.environment.items() if not _per_worker(key)}
        return now == then and os.getcwd() == self.cwd and self.process.poll() is None

    def spawn(self, argv: list[str], log_path: str) -> ForkedProcess:
        """A worker running `rollout-worker *argv`, writing to `log_path`."""
        request = {
            "argv": argv,
            "argv0": "rollout-worker",
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "log": log_path,
        }
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            self._log.seek(0)
            raise RuntimeError("the worker zygote ended: " + self._log.read().decode(errors="replace")[-4000:])
        pid = json.loads(reply)["pid"]
        return ForkedProcess(pid, ["rollout-worker", *argv], self.status_dir / str(pid))

    def close(self) -> None:
        """End the zygote (its stdin closes) and remove its files; workers still running are their owners' to stop."""
        self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self._log.close()
        for leftover in self.status_dir.iterdir():
            leftover.unlink()
        self.status_dir.rmdir()


_zygote: Zygote | None = None


def zygote() -> Zygote:
    """The session's zygote, started on first use."""
    global _zygote
    if _zygote is None or _zygote.process.poll() is not None:
        _zygote = Zygote()
    return _zygote


def close() -> None:
    """Stop the session's zygote, if one was started."""
    global _zygote
    if _zygote is not None:
        _zygote.close()
        _zygote = None


if __name__ == "__main__":
    worker_request = serve(Path(sys.argv[1]))
    if worker_request is not None:
        from rollout.service.launch.cli import console_main

        console_main(worker_request["argv"])
