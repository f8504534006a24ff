"""The worker's side of the compile server (server.py): starts it (it dies with the worker), asks it whether
specs compile within the budget, and starts it again when it died. Compile slots (constraint_compiles.py) call
`check` from their threads; any thread may `wake` them (a job was cancelled).

The server is started by a thread of its own, which then reads its answers until it ends: Linux's parent-death signal
follows the thread that started a process, so the server must be started by a thread that lives as long as it does.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import rollout
from rollout.service.compile.frames import HEADER, READ_BYTES, decode, encode

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # importing xgrammar and torch takes seconds (more on a loaded machine)
ANSWER_GRACE_S = 5.0  # past a job's deadline, how long the server has to answer before it is taken for hung
RESTART_BACKOFF_S = 5.0  # after the server failed to start, compiles are refused this long before it is tried again


class CompileLink:
    """A compile server, started on first use (or `start`), its answers handed to the slot threads waiting."""

    def __init__(self, tokenizer_info: Callable[[], str], max_seconds: float, max_bytes: int, children: int = 2):
        """
        Args:
            tokenizer_info: the served tokenizer's xgrammar TokenizerInfo as JSON (called once per server start).
            max_seconds: each compile's deadline.
            max_bytes: each compile's memory budget.
            children: compile processes the server keeps ready (as many as compiles run at once).
        """
        self._tokenizer_info = tokenizer_info
        self.max_seconds = max_seconds
        self.max_bytes = max_bytes
        self.children = children
        self._changed = threading.Condition()  # answers arrived, the server's state changed, a job was cancelled
        self._answers: dict[tuple[int, str], dict[str, Any]] = {}  # by (job, "status" or "grammar")
        self._process_of: dict[int, subprocess.Popen] = {}  # the server each job in flight was sent to
        self._process: subprocess.Popen | None = None
        self._state = "stopped"  # "starting", "ready", "stopped", "failed", "closed"
        self._failed_at = 0.0
        self._failure = ""
        self._write_lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        """Start the server in the background, unless it runs, starts, or failed to start moments ago."""
        with self._changed:
            if self._state in ("starting", "ready", "closed"):
                return
            if self._state == "failed" and time.monotonic() - self._failed_at < RESTART_BACKOFF_S:
                return
            self._state = "starting"
            self._reader = threading.Thread(target=self._run, name="rollout-compile-server", daemon=True)
            self._reader.start()

    def check(self, job: int, field: str, spec: Any, cancelled: Callable[[], bool]) -> dict[str, Any]:
        """Compile `spec` in the server and wait for its answer (a slot thread).

        Args:
            job: the job's number (unique per link).
            field, spec: the constraint.
            cancelled: whether the job was abandoned meanwhile (checked whenever `wake` is called): the server
                then kills its child.
        Returns:
            The server's answer ({"status": ...}); "unavailable" (with "message") when there is no server to ask.
            After "ok", call `grammar` for the compiled grammar.
        """
        self.start()
        with self._changed:
            self._changed.wait_for(lambda: self._state != "starting" or cancelled(), START_TIMEOUT_S)
            if cancelled():
                return {"status": "cancelled"}
            if self._state != "ready":
                return {"status": "unavailable", "message": self._failure or "the compile server did not start"}
            process = self._process
        if not self._send(process, {"op": "start", "job": job, "field": field, "spec": spec}):
            return {"status": "unavailable", "message": "the compile server is gone"}
        self._process_of[job] = process
        answer = self._wait((job, "status"), cancelled)
        if answer.get("status") != "ok":
            self._process_of.pop(job, None)
        return answer

    def grammar(self, job: int, cancelled: Callable[[], bool]) -> str | None:
        """The grammar a job compiled, as xgrammar's JSON, after `check` answered "ok" (a slot thread).

        Returns:
            The JSON, or None: quick enough to compile again, written too slowly, or no server to ask.
        """
        answer = self._wait((job, "grammar"), cancelled)
        self._process_of.pop(job, None)
        return answer.get("grammar")

    def _wait(self, key: tuple[int, str], cancelled: Callable[[], bool]) -> dict[str, Any]:
        """The server's answer `key` (job, "status" or "grammar"); a cancelled job's child is killed first."""
        job = key[0]
        process = self._process_of.get(job)
        limit = time.monotonic() + self.max_seconds + ANSWER_GRACE_S
        told = False
        with self._changed:
            while key not in self._answers:
                if process is None or self._process is not process:
                    return {"status": "unavailable", "message": self._failure or "the compile server stopped"}
                if cancelled() and not told:
                    told = True
                    limit = min(limit, time.monotonic() + ANSWER_GRACE_S)
                    self._changed.release()  # never hold the lock across a pipe write
                    try:
                        self._send(process, {"op": "cancel", "job": job})
                    finally:
                        self._changed.acquire()
                    continue
                remaining = limit - time.monotonic()
                if remaining <= 0:
                    logger.error("the compile server did not answer in time; restarting it")
                    self._failure = "the compile server stopped answering"
                    process.kill()
                    return {"status": "unavailable", "message": self._failure}
                self._changed.wait(remaining)
            return self._answers.pop(key)

    def wake(self) -> None:
        """Wake the slot threads waiting in `check` (a job was cancelled)."""
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        """Stop the server (its children die with it) and wake everyone waiting."""
        with self._changed:
            self._state = "closed"
            process, reader = self._process, self._reader
            self._changed.notify_all()
        if process is not None:
            try:
                process.stdin.close()  # the server ends at the end of its input, killing its children
                process.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                process.kill()
                process.wait()
        if reader is not None and reader is not threading.current_thread():
            reader.join(10)

    @property
    def pid(self) -> int | None:
        """The server's process id (None: not running)."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    # ---- the reader thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        """Start the server, hand it the tokenizer, then read its answers until it ends."""
        process = None
        try:
            info = self._tokenizer_info()
            command = [sys.executable, "-m", "rollout.service.compile.server", str(os.getpid())]
            # The server imports this same rollout, wherever the worker found it (not only an installed one).
            paths = [str(Path(rollout.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path)}
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            with self._changed:
                if self._state == "closed":
                    process.kill()
                    process.wait()
                    return
                self._process = process
            hello = {"tokenizer_info": info, "max_seconds": self.max_seconds, "max_bytes": self.max_bytes}
            hello["children"] = self.children
            if not self._send(process, hello):
                raise OSError("the compile server ended before it was ready")
            self._read(process)
        except Exception as error:  # noqa: BLE001 - no compile server: constraints are refused until it starts
            logger.exception("the compile server failed")
            self._failure = f"the compile server failed: {error}"
        finally:
            if process is not None and process.poll() is None:
                process.kill()
            if process is not None:
                process.wait()
            with self._changed:
                if self._state == "starting":
                    self._state, self._failed_at = "failed", time.monotonic()
                    self._failure = self._failure or f"the compile server exited ({process and process.returncode})"
                elif self._state == "ready":
                    self._state = "stopped"
                self._process = None
                self._changed.notify_all()

    def _read(self, process: subprocess.Popen) -> None:
        inbox = bytearray()
        out = process.stdout.fileno()
        while True:
            data = os.read(out, READ_BYTES)
            if not data:
                return
            inbox += data
            if len(inbox) < HEADER.size:
                continue
            with self._changed:
                for message in decode(inbox):
                    if message.get("ready"):
                        if self._state == "starting":
                            self._state = "ready"
                    else:
                        self._answers[(message["job"], "grammar" if "grammar" in message else "status")] = message
                self._changed.notify_all()

    def _send(self, process: subprocess.Popen, message: dict[str, Any]) -> bool:
        """Write one frame to the server (False: it is gone)."""
        try:
            with self._write_lock:
                process.stdin.write(encode(message))
                process.stdin.flush()
            return True
        except (OSError, ValueError):  # a broken pipe, or stdin closed by `close`
            return False
