"""Structured-output constraints compiled off the worker's serving loop, within a budget, taking turns by client.

Compiling a grammar against a production vocabulary takes milliseconds for a typical JSON schema, but a crafted
grammar under the 64 KiB cap takes minutes; an xgrammar compile cannot be interrupted in a thread. So a spec never
seen before goes through a compile slot (`CompileBudget.slots` threads):

1. a fair queue (fair_queue.py): clients take turns, each holds at most slots - 1 slots, and each has a bounded
   number of compiles waiting;
2. the compile server (compile_server.py, a child process) compiles it in a forked child under the time and memory
   budget, killed past either, or as soon as its client cancels or leaves; a spec refused so is refused by name (and
   remembered: sent again, it is refused at once);
3. the worker reads the grammar the child compiled (xgrammar's JSON, when it comes within as long as its compile
   took) or else compiles it itself (about as long as the child took: the budget bounds it) into the engine's
   grammar cache, with its admission checks (rollout/engine/grammar/checks.py), so the engine's own compile of it
   (`RequestIntake.constraint`) is a cache hit.

A spec in the cache skips all three: its checks run at once on a small thread pool of their own. The HTTP front end
and the ZeroMQ socket share one `ConstraintCompiles` (their clients take turns together); a job's `done` is called
exactly once, from a slot or pool thread, or from the caller's thread when it is cancelled or refused waiting.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rollout.config import FieldError, SamplingParams
from rollout.constraints import constraint_of
from rollout.engine.manager.continuous_batching import QueueFullError
from rollout.service.compile.fair_queue import FairQueue, QueueBusy
from rollout.service.compile.jobs import CompileAbandoned, CompileBudget, CompileJob, CompilesClosed
from rollout.service.compile.link import ANSWER_GRACE_S, CompileLink

logger = logging.getLogger(__name__)

CHECK_THREADS = 2  # the checks of cached specs (each bounded: grammar_checks.MAX_CHECK_FILLS masks)
MAX_REFUSALS = 1024  # specs remembered as refused (past their budget, or not compiling), least recent dropped


class ConstraintCompiles:
    """The compile slots of one worker (one engine intake)."""

    def __init__(self, intake: Any, budget: CompileBudget | None = None):
        """
        Args:
            intake: the engine's RequestIntake (its tokenizer, vocabulary, grammar cache and `constraint`).
            budget: the limits (CompileBudget's defaults when None).
        """
        self.intake = intake
        self.budget = budget or CompileBudget()
        grammars = intake.grammars
        self.link = CompileLink(
            lambda: grammars.tokenizer_info(intake.tokenizer, intake.vocab_size).serialize_json(),
            self.budget.max_seconds,
            self.budget.max_bytes,
            self.budget.slots,
        )
        running = max(1, self.budget.slots - 1)
        self._queue: FairQueue[CompileJob] = FairQueue(self.budget.max_waiting, self.budget.max_per_client, running)
        self._changed = threading.Condition()
        self._numbers = itertools.count()
        self._slots: list[threading.Thread] = []
        self._checks = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="rollout-constraint-check")
        self._refused: OrderedDict[bytes, FieldError] = OrderedDict()  # by `_digest`: specs may be 64 KiB
        self._active: set[CompileJob] = set()  # jobs whose `done` was not called yet
        self._closed = False

    def start(self, server: bool = True) -> None:
        """Compile `json_object` (the one spec every client may send) into the cache, in the background, so that it
        never waits for a compile slot; and start the compile server now, in the background.

        Args:
            server: start the compile server now; False: the first spec that needs it starts it (a worker that
                serves no new spec never runs it: it imports xgrammar and torch, seconds of a core).
        """
        if self._compiles_here():
            if server:
                self.link.start()
            self._checks.submit(self._warm)

    def submit(
        self, client: Hashable, sampling: Any, done: Callable[[CompileJob, BaseException | None], None], item: Any
    ) -> CompileJob:
        """Compile and check `sampling`'s constraint; `done(job, error)` is called once when it is ready (error
        None), refused (a FieldError naming the field), abandoned (CompileAbandoned) or not compiled because the
        worker stops (CompilesClosed) or cannot compile (CompilesUnavailable).

        Args:
            client: who sent it: its turn in the queue (the HTTP client's address; over ZeroMQ its key with keys
                on, else its connection: `GroupInFlight.client`).
            sampling: the request's SamplingParams (it has a constraint).
            done: called with the job and its outcome.
            item: carried in the job for the caller.
        Raises:
            QueueFullError: too many compiles waiting, for this client or in all (answer "busy").
        """
        field, spec = constraint_of(sampling)
        job = CompileJob(next(self._numbers), client, sampling, field, spec, done, item)
        with self._changed:
            if self._closed:
                raise QueueFullError("the worker is stopping; retry")
            refused = self._refused.get(_digest(field, spec))
            if refused is None and not self._is_cached(job):
                try:
                    self._queue.push(client, job)
                except QueueBusy as error:
                    raise QueueFullError(str(error)) from None
                self._active.add(job)
                self._grow_slots()
                self._changed.notify_all()
                return job
            job.state = "fast"
            self._active.add(job)
        if refused is not None:
            self._finish(job, FieldError(field, refused.reason))
        else:
            self._checks.submit(self._fast, job)
        return job

    def cancel(self, job: CompileJob) -> None:
        """Abandon a job: out of the queue if it waits (`done` now), its compile process killed if it runs (`done`
        once it is gone); a compile in this process cannot be interrupted, its result is dropped."""
        with self._changed:
            if job.cancelled or job.state == "finished":
                return
            job.cancelled = True
            removed = job.state == "waiting" and self._queue.remove(job.client, job)
        if removed:
            self._finish(job, CompileAbandoned())
        else:
            self.link.wake()

    def cancel_client(self, client: Hashable) -> None:
        """Abandon every job of a client that is gone."""
        with self._changed:
            jobs = [job for job in self._active if job.client == client]
        for job in jobs:
            self.cancel(job)

    def close(self) -> None:
        """Stop: every waiting job ends with CompilesClosed, running ones are killed (a compile in this process is
        waited for: the budget bounds it); the compile server and the threads end."""
        with self._changed:
            self._closed = True
            waiting = self._queue.drain()
            self._changed.notify_all()
        for job in waiting:
            self._finish(job, CompilesClosed())
        self.link.close()
        for slot in self._slots:
            slot.join(self.budget.max_seconds + ANSWER_GRACE_S)
        self._checks.shutdown(wait=True)

    @property
    def num_active(self) -> int:
        """Jobs not ended yet (waiting, compiling, or being checked)."""
        with self._changed:
            return len(self._active)

    # ---- slots ----------------------------------------------------------------------------------------------------
    def _grow_slots(self) -> None:
        """Start another slot thread if every one is busy (under the lock)."""
        if len(self._slots) < self.budget.slots:
            slot = threading.Thread(target=self._slot, name=f"rollout-compile-{len(self._slots)}", daemon=True)
            self._slots.append(slot)
            slot.start()

    def _slot(self) -> None:
        while True:
            with self._changed:
                # (a client at its share of slots is skipped by `pop`: woken again when one of its jobs ends)
                while not self._closed and (taken := self._queue.pop()) is None:
                    self._changed.wait()
                if self._closed:
                    return
                client, job = taken
                job.state = "checking"
            try:
                error = self._run(job)
            except Exception as unexpected:  # noqa: BLE001 - a slot outlives any one job
                logger.exception("compiling a constraint failed")
                error = unexpected
            with self._changed:
                self._queue.done(client)
                self._changed.notify_all()
            self._finish(job, error)

    def _run(self, job: CompileJob) -> BaseException | None:
        """A queued job: proven in the compile server (unless cached meanwhile), then compiled and checked here.
        json_object skips the server: its spec is fixed, its compile time the vocabulary's, not a client's doing."""
        if job.field != "json_object" and not self._is_cached(job):
            given_up = lambda: job.cancelled or self._closed  # noqa: E731 - asked again while waiting
            answer = self.link.check(job.number, job.field, job.spec, given_up)
            # After "ok" the grammar (or None) always follows: collected even when given up, never left behind.
            grammar_json = self.link.grammar(job.number, given_up) if answer["status"] == "ok" else None
            if given_up():
                return CompileAbandoned() if job.cancelled else CompilesClosed()
            refusal = self.budget.refusal(job.field, answer)
            if refusal is not None:
                if isinstance(refusal, FieldError):
                    self._remember(job, refusal)
                return refusal
            if grammar_json is not None:
                self._adopt(job, grammar_json)
        job.state = "compiling"
        return self._compile(job)

    def _adopt(self, job: CompileJob, grammar_json: str) -> None:
        """Cache the grammar the compile process sent (on failure, `_compile` compiles it here instead)."""
        intake = self.intake
        try:
            intake.grammars.adopt(intake.tokenizer, intake.vocab_size, job.field, job.spec, grammar_json)
        except Exception:  # noqa: BLE001 - an xgrammar version or format mismatch: compiled here instead
            logger.exception("a compiled grammar from the compile server could not be read; compiling it here")

    def _warm(self) -> None:
        try:
            self.intake.constraint(self.intake.resolve_sampling(SamplingParams(json_object=True)))
        except Exception:  # noqa: BLE001 - a warm-up: the first request's own compile says what is wrong
            logger.exception("compiling json_object ahead of requests failed")

    def _fast(self, job: CompileJob) -> None:
        """A cached spec (or none can compile here): its checks only, on the check threads."""
        self._finish(job, self._compile(job))

    def _compile(self, job: CompileJob) -> BaseException | None:
        """Compile (or find) and check the job's constraint in this process, as the engine will."""
        try:
            self.intake.constraint(self.intake.resolve_sampling(job.sampling))
        except Exception as error:  # noqa: BLE001 - a FieldError names the field; anything else is answered too
            return error
        return CompileAbandoned() if job.cancelled else None

    def _finish(self, job: CompileJob, error: BaseException | None) -> None:
        with self._changed:
            if job.state == "finished":
                return
            job.state = "finished"
            self._active.discard(job)
        try:
            job.done(job, error)
        except Exception:  # noqa: BLE001 - one caller's callback must not stop a slot
            logger.exception("a compile's callback failed")

    # ---- helpers --------------------------------------------------------------------------------------------------
    def _is_cached(self, job: CompileJob) -> bool:
        """Whether the job's spec needs no compile here: compiled already, or nothing can compile (no xgrammar,
        no tokenizer: the engine's compile then refuses it by name at once)."""
        if not self._compiles_here():
            return True
        return self.intake.grammars.is_cached(self.intake.tokenizer, self.intake.vocab_size, job.field, job.spec)

    def _compiles_here(self) -> bool:
        from rollout.engine.grammar import constraints as grammar

        return grammar.xgrammar is not None and self.intake.tokenizer is not None

    def _remember(self, job: CompileJob, refusal: FieldError) -> None:
        with self._changed:
            # a copy: the refusal itself is raised by its caller, and its traceback would hold the caller's frames
            self._refused[_digest(job.field, job.spec)] = FieldError(refusal.field, refusal.reason)
            while len(self._refused) > MAX_REFUSALS:
                self._refused.popitem(last=False)


def _digest(field: str, spec: Any) -> bytes:
    """A constraint's identity in a few bytes (a refused spec is remembered by it, not kept)."""
    return hashlib.blake2b(json.dumps([field, spec]).encode(), digest_size=16).digest()  # (surrogates escaped)
