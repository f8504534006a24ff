"""The compile server: a child process of the worker that proves a structured-output spec compiles within the
worker's time and memory budget (`--max-compile-s`, `--max-compile-bytes`), where the worker's own threads could not:
an xgrammar compile cannot be interrupted in a thread.

It imports xgrammar once, then forks children that compile (compile_child.py): a fork costs milliseconds where a
fresh interpreter importing xgrammar and torch costs seconds, and a child compiles job after job, so a job costs two
pipe hops. The server SIGKILLs a child past its job's deadline or when the worker cancels the job, and forks a
replacement once idle. A grammar that took a while to compile comes back as xgrammar's JSON, if written in half
the time its compile took (MAX_SEND_S at most): xgrammar's serialization of some grammars grows with the square of their rules (tens of
MB, seconds to write and to read), and past that the worker compiles it again itself, which takes about the time the
child took (the budget bounds it). compile_link.py is the worker's side.

Protocol (stdin, stdout; compile_frames.py): the worker sends first {"tokenizer_info": ..., "max_seconds": s,
"max_bytes": b, "children": n}, then {"op": "start", "job": id, "field": f, "spec": s} and {"op": "cancel", "job":
id}; the server answers {"ready": true} once, then {"job": id, "status": s, ...} once per started job, s one of
"ok", "error" (with xgrammar's "message"), "timeout", "memory", "crashed" (with "signal" or "exit_code") or
"cancelled", with "seconds" (the compile's); after "ok", once more {"job": id, "grammar": JSON or null}. Every child
dies with the server, and the server with the worker (PR_SET_PDEATHSIG, and the end of its stdin).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rollout.process_groups import die_with_parent
from rollout.service.compile.child import RECYCLE_AFTER, serve_jobs
from rollout.service.compile.frames import READ_BYTES, decode, read_frame, write_frame

# Idle children are forked once the server had nothing to do this long: a fork copies the page tables of a process
# holding torch (10-30 ms on a small machine), which must not delay a compile's answer.
IDLE_S = 0.02
# How long a compiled grammar's JSON may take to write: half its compile (it is read in about half the time it took
# to write: worth it only while cheaper than compiling again), at least MIN_SEND_S, at most MAX_SEND_S (a slot waits).
MIN_SEND_S, MAX_SEND_S = 0.05, 1.0


@dataclass
class _Child:
    """A forked child: idle, or compiling a job until its deadline."""

    pid: int
    job_fd: int  # jobs go in here
    answer_fd: int  # answers come out here
    job: int | None = None
    deadline: float = float("inf")
    inbox: bytearray = field(default_factory=bytearray)
    answered: int = 0
    retiring: bool = False  # it exits after its last answer (compile_child.py): never handed another job
    sending: bool = False  # its job compiled; its grammar's JSON is being written (deadline: MIN_SEND_S or so)


class _Server:
    """The server's loop: jobs in on stdin, each handed to an idle child, the answers out on the protocol channel."""

    def __init__(self, out: int, info: Any, settings: dict[str, Any]):
        self.out, self.info = out, info
        self.max_seconds, self.max_bytes = float(settings["max_seconds"]), int(settings["max_bytes"])
        self.spares = int(settings.get("children", 2))  # idle children kept ready
        self.children: dict[int, _Child] = {}  # by answer descriptor
        self.exited: list[int] = []  # children whose pipe closed, to reap

    def serve(self, inbox: bytearray) -> None:
        """Run until stdin ends (`inbox`: what was read past the first frame)."""
        try:
            for message in decode(inbox):
                self._handle(message)
            while True:
                deadline = min((child.deadline for child in self.children.values()), default=float("inf"))
                timeout = None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
                if self.exited or len(self._idle()) < self.spares:  # reap, fork, once idle
                    timeout = IDLE_S if timeout is None else min(timeout, IDLE_S)
                readable, _, _ = select.select([0, *self.children], [], [], timeout)
                for fd in readable:
                    if fd == 0:
                        data = os.read(0, READ_BYTES)
                        if not data:
                            return  # the worker closed its end, or is gone
                        inbox += data
                        for message in decode(inbox):
                            self._handle(message)
                    elif fd in self.children:
                        self._read_child(self.children[fd])
                now = time.monotonic()
                for child in [c for c in self.children.values() if c.deadline <= now]:
                    self._kill(child, {"grammar": None} if child.sending else {"status": "timeout"})
                self.exited = [pid for pid in self.exited if os.waitpid(pid, os.WNOHANG)[0] == 0]
                if not readable and len(self._idle()) < self.spares:
                    self._fork()
        finally:
            for child in list(self.children.values()):
                self._kill(child, None)

    def _idle(self) -> list[_Child]:
        return [child for child in self.children.values() if child.job is None and not child.retiring]

    def _handle(self, message: dict[str, Any]) -> None:
        if message.get("op") == "cancel":
            for child in list(self.children.values()):
                if child.job == message["job"]:
                    self._kill(child, {"grammar": None} if child.sending else {"status": "cancelled"})
            return
        while True:
            idle = self._idle()
            child = idle[0] if idle else self._fork()
            try:
                write_frame(child.job_fd, {"field": message["field"], "spec": message["spec"]})
                break
            except BrokenPipeError:  # it exited after its last answer (out of memory, or recycled): another one
                self._forget(child)
                self.exited.append(child.pid)
        child.job, child.deadline = message["job"], time.monotonic() + self.max_seconds

    def _fork(self) -> _Child:
        job_read, job_write = os.pipe()
        answer_read, answer_write = os.pipe()
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns into this loop
            try:
                die_with_parent(server_pid)
                os.dup2(os.open(os.devnull, os.O_RDWR), 0)  # the worker's pipe is the server's alone
                others = [fd for child in self.children.values() for fd in (child.job_fd, child.answer_fd)]
                for fd in (job_write, answer_read, self.out, *others):
                    os.close(fd)
                serve_jobs(job_read, answer_write, self.info, self.max_bytes)
            finally:
                os._exit(0)
        os.close(job_read)
        os.close(answer_write)
        child = _Child(pid, job_write, answer_read)
        self.children[answer_read] = child
        return child

    def _read_child(self, child: _Child) -> None:
        data = os.read(child.answer_fd, READ_BYTES)
        if data:
            child.inbox += data
            for answer in decode(child.inbox):
                self._send({"job": child.job, **answer})
                if answer.get("status") == "ok":  # its grammar's JSON follows, if written in time
                    child.sending = True
                    child.deadline = time.monotonic() + min(max(answer["seconds"] / 2, MIN_SEND_S), MAX_SEND_S)
                    continue
                child.job, child.deadline, child.sending = None, float("inf"), False
                child.answered += 1
                child.retiring = answer.get("status") == "memory" or child.answered >= RECYCLE_AFTER
            return
        self._forget(child)  # it exited (by itself after its answer, or it died)
        if child.job is None:
            self.exited.append(child.pid)
            return
        _, status = os.waitpid(child.pid, 0)
        if child.sending:  # it died writing the JSON (out of memory): the worker compiles the grammar itself
            self._send({"job": child.job, "grammar": None})
            return
        answer = {"status": "crashed"}
        if os.WIFSIGNALED(status):
            answer["signal"] = os.WTERMSIG(status)
        else:
            answer["exit_code"] = os.WEXITSTATUS(status)
        self._send({"job": child.job, **answer})

    def _kill(self, child: _Child, answer: dict[str, Any] | None) -> None:
        """Kill a child (past its deadline, its job cancelled, or the server ending) and answer for its job."""
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(child.pid, 0)
        self._forget(child)
        if answer is not None:
            self._send({"job": child.job, **answer})

    def _forget(self, child: _Child) -> None:
        del self.children[child.answer_fd]
        os.close(child.answer_fd)
        os.close(child.job_fd)

    def _send(self, message: dict[str, Any]) -> None:
        write_frame(self.out, message)


def main(argv: list[str]) -> int:
    """Serve compiles for the worker whose pid is argv[1] (on stdin and stdout) until it closes stdin or dies."""
    die_with_parent(int(argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C is the worker's to handle: it ends this process
    out = os.dup(1)
    os.dup2(2, 1)  # what libraries print goes to stderr, never into the protocol
    import xgrammar

    import rollout.engine.grammar.constraints  # noqa: F401 - imported once here, so that every child finds it loaded

    inbox = bytearray()
    settings = read_frame(0, inbox)
    if settings is None:
        return 0
    info = xgrammar.TokenizerInfo.deserialize_json(settings["tokenizer_info"])
    write_frame(out, {"ready": True})
    _Server(out, info, settings).serve(inbox)
    return 0


if __name__ == "__main__":
    os._exit(main(sys.argv))  # (its children are gone; an interpreter holding torch takes a second to tear down)
