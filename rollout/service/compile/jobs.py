"""What a structured-output compile is, to the worker's compile slots (constraint_compiles.py): a job, the budget
it runs under, and the ways it can end other than compiled."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from rollout.config import FieldError


class CompileAbandoned(Exception):
    """The job was given up: its client cancelled it or left (nobody waits for it)."""


class CompilesClosed(Exception):
    """The worker is stopping: the job was not compiled (retry elsewhere)."""


class CompilesUnavailable(RuntimeError):
    """No compile server could be asked (it failed to start, or died): the worker's fault, not the spec's."""


@dataclass
class CompileBudget:
    """What one compile may take, and how many a client may have queued (rollout-worker's --max-compile-* flags).

    Attributes:
        max_seconds: a compile still running after this long is killed and its spec refused by name.
        max_bytes: memory one compile may allocate (its process's data segment past what it started with).
        max_per_client: compiles one client may have waiting or running; more are answered "busy".
        slots: compiles running at once (processes); one client holds at most slots - 1 of them (at least 1).
        max_waiting: compiles waiting, all clients together; more are answered "busy".
    """

    max_seconds: float = 10.0
    max_bytes: int = 1 << 30
    max_per_client: int = 32
    slots: int = 2
    max_waiting: int = 64

    def refusal(self, field: str, answer: dict[str, Any]) -> BaseException | None:
        """The error of a compile server's answer (None: it compiled in time).

        Args:
            field: the constraint's field (named by the error).
            answer: the server's answer (server.py).
        """
        status = answer["status"]
        if status == "ok":
            return None
        if status == "timeout":
            return FieldError(field, f"did not compile within {self.max_seconds:g} s (this worker's --max-compile-s)")
        budget = f"{self.max_bytes / (1 << 20):g} MiB (this worker's --max-compile-bytes)"
        if status == "memory":
            return FieldError(field, f"needs more memory to compile than {budget}")
        if status == "crashed":  # an allocation failing in a thread of xgrammar aborts its process
            return FieldError(field, f"ended its compile process ({_ended(answer)}); its memory budget is {budget}")
        if status == "error":
            return FieldError(field, f"does not compile: {answer.get('message', '')}")
        if status == "cancelled":
            return CompileAbandoned()
        return CompilesUnavailable(f"structured outputs cannot be compiled now: {answer.get('message', status)}")


def _ended(answer: dict[str, Any]) -> str:
    if "signal" in answer:
        return f"signal {answer['signal']}"
    return f"exit code {answer.get('exit_code')}"


@dataclass(eq=False)
class CompileJob:
    """One request's constraint on its way through the compile slots (compared by identity)."""

    number: int  # unique per ConstraintCompiles: the compile server's job id
    client: Hashable  # whose turn it takes in the fair queue
    sampling: Any  # the request's SamplingParams
    field: str
    spec: Any
    done: Callable[[CompileJob, BaseException | None], None]  # called once: None (compiled) or why not
    item: Any = None  # what the caller needs back with it
    state: str = "waiting"  # "waiting" (queued), "fast" (cached: checks only), "checking" (in the server),
    # "compiling" (in this process), "finished" (done was called or is being called)
    cancelled: bool = False
