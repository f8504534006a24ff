"""The Triton compile proof of tests/test_kernel_compile.py, started as soon as the suite's tests are collected and at
the lowest CPU priority: it is a minute or more of every core's work, independent of every other test, so it compiles
on the cycles the other tests leave idle (waiting for workers, sockets, subprocesses) and its fixture waits only for
what is left. Run alone (`pytest tests/test_kernel_compile.py`), it starts the same way and is simply waited for.

With pytest-xdist (`-n 2`), the controlling process starts the one job (`start(shared=True)`) and hands its folder to
the test processes (conftest), which read its results from there (`attach`): every file it writes is in that folder,
its exit status included (written by a thread of the process that started it)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rollout.process_groups import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
# How long the test waits for what is left of the compile once it needs it (the suite's timeout for one test is 300 s).
# Counted from then, not from the start: on a busy machine the niced job may have had no idle cycle before.
TIMEOUT_S = 280.0


class CompileJob:
    """`python -m rollout.benchmarks.kernels.compile --matrix suite` in the background, niced, with a fresh Triton cache
    (so every variant really compiles) and TRITON_INTERPRET unset (the interpreter's kernels cannot be compiled).

    Its folder holds the log, the results (`results.json`) and, once it ended, its exit status (`returncode`)."""

    def __init__(self, group_nice: int = 19) -> None:
        """`group_nice`: its niceness and its scheduling group's (below; 19: only the cycles no one else wants)."""
        self.directory = Path(tempfile.mkdtemp(prefix="triton_compile_"))
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        env.update(TRITON_CACHE_DIR=str(self.directory / "cache"), TRITON_DEFAULT_FP_FUSION="1")  # 1: 3.9's default
        workers = str(len(os.sched_getaffinity(0)))
        command = [
            sys.executable,
            "-m",
            "rollout.benchmarks.kernels.compile",
            "--matrix",
            "suite",
            "--workers",
            workers,
        ]
        self.log = open(self.directory / "log.txt", "w+")  # noqa: SIM115 - closed by close()
        self.process = subprocess.Popen(
            ["nice", "-n", str(group_nice), *command, "--json", str(self.directory / "results.json")],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own scheduling group, lowered next
            preexec_fn=functools.partial(die_with_parent, os.getpid()),  # even if pytest is killed outright
        )
        _lower_group_priority(self.process.pid, group_nice)
        self._exit_recorder = threading.Thread(target=self._record_exit, name="kernel-compile-exit", daemon=True)
        self._exit_recorder.start()

    def _record_exit(self) -> None:
        returncode = self.process.wait()
        partial = self.directory / "returncode.part"
        partial.write_text(str(returncode))
        partial.rename(self.directory / "returncode")

    def close(self) -> None:
        """Stop the compile if it still runs, and remove its files."""
        self._kill()
        self._exit_recorder.join()
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _kill(self) -> None:
        """End the compile and its worker processes: they share its process group (its own session); killing the
        compile alone would leave them compiling on, orphaned."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already
        self.process.wait()


def results_in(directory: Path) -> dict:
    """The results of the compile writing to `directory`, waiting up to TIMEOUT_S for the rest of it (it has the
    cycles the waiting test leaves idle).

    Raises:
        AssertionError: the compile failed or ran past TIMEOUT_S (with its output's tail).
    """
    deadline = time.monotonic() + TIMEOUT_S
    status = directory / "returncode"
    while not status.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    log = (directory / "log.txt").read_text(errors="replace")[-4000:]
    assert status.exists(), f"the compile ran past {TIMEOUT_S:.0f} s:\n{log}"
    assert status.read_text() == "0", log
    return json.loads((directory / "results.json").read_text())


def _lower_group_priority(pid: int, nice: int) -> None:
    """With the kernel's autogroups (one per session), CPU time is shared between sessions before niceness counts
    inside one: a niced compile in its own session would still take half the machine from a test's subprocess in
    another. Its session's group is niced too, so it gets only what no other group wants."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as group:
            group.write(str(nice))
    except OSError:  # no autogroups (or not Linux): niceness alone applies
        pass


_job: CompileJob | None = None
_attached: Path | None = None  # the folder of a job another process started (pytest-xdist's controller)


def start(group_nice: int = 19) -> Path:
    """Start the compile (once per session); returns its folder.

    Args:
        group_nice: 19 when the tests leave cycles idle (one test process); lower where they leave none (pytest-xdist
            keeps both cores busy, and a compile left only idle cycles would still run when its test waits for it).
    """
    global _job
    if _job is None:
        _job = CompileJob(group_nice)
    return _job.directory


def attach(directory: Path) -> None:
    """Read the results of the job another process started in `directory` instead of starting one."""
    global _attached
    _attached = directory


def result() -> dict:
    """The compile's results, starting it first when the session did not (waits for it to finish)."""
    return results_in(_attached if _attached is not None else start())


def close() -> None:
    """Stop and clean up the session's compile, if one was started here."""
    global _job
    if _job is not None:
        _job.close()
        _job = None
