"""The manager's engine thread: it applies the commands other threads left in its mailbox, applies a weight update
when one can go in, steps the engine and delivers the outputs; when the manager stops (or the thread fails) it
refuses what is still queued, ends what runs and gives the model back."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from rollout.config import FieldError
from rollout.engine.engine import Engine
from rollout.engine.manager.commands import (
    AddGroup,
    ApplyWeights,
    CancelGroup,
    Command,
    EngineCall,
    GenerationPauseCommand,
    PauseLoop,
    Wake,
)
from rollout.engine.manager.generation_pause import GenerationPause
from rollout.engine.manager.pause import PauseGate
from rollout.engine.manager.request_desk import RequestDesk
from rollout.engine.manager.weight_queue import WeightUpdateQueue
from rollout.engine.requests.adapter_ref import AdapterUnloaded
from rollout.engine.requests.intake import TRANSFORMERS_FIELD_NAMES
from rollout.engine.requests.outputs import GenerationOutput, never_started
from rollout.engine.requests.request import Request
from rollout.mailbox import drain

logger = logging.getLogger("rollout.engine.manager.continuous_batching")


class LoopOwner(Protocol):
    """The manager's public state the loop writes and reads (structural: this module does not import the manager)."""

    error: BaseException | None
    idle_s: float
    stopped_at: float | None
    step_observer: Callable[[float], None] | None


class EngineLoop:
    """The engine side of a `ContinuousBatchingManager`: its engine thread's body and shutdown."""

    def __init__(
        self,
        owner: LoopOwner,
        engine: Engine,
        requests: RequestDesk,
        updates: WeightUpdateQueue,
        commands: queue.SimpleQueue[Command],
        lock: threading.Condition,
        deliver: Callable[[list[GenerationOutput]], None],
        generation: GenerationPause,
    ):
        """
        Args:
            owner: the manager (a weak proxy): the loop records its error, idle time and step times there.
            engine: the engine the loop steps (only this thread touches it while the loop runs).
            requests: the manager's request desk (groups on their way, counted until the engine takes them).
            updates: the manager's weight updates, applied between two steps.
            commands: the loop's mailbox.
            lock: the manager's lock (waiters are woken under it when the loop ends).
            deliver: hands outputs to their readers and handlers.
            generation: the generation pause (vLLM's pause_generation): no steps while it holds.
        """
        self.owner = owner
        self.engine = engine
        self.requests = requests
        self.updates = updates
        self.commands = commands
        self.lock = lock
        self.deliver = deliver
        self.stopping = threading.Event()  # set when the manager stops: the loop ends after its current step
        # Set by `stop(hard_stop=False)`: no group is added any more, and the loop ends once every group added before
        # has finished (or at once while a generation pause holds: then as `stopping`).
        self.flushing = threading.Event()
        self.generation = generation
        self._thread: threading.Thread | None = None

    # ---- the thread, as the manager starts and stops it ---------------------------------------------------------
    def start(self, keep_alive: object) -> None:
        """Start the thread; it holds `keep_alive` (the manager) until the loop returns.

        Raises:
            RuntimeError: the loop was stopped (a manager does not restart).
        """
        if self.stopping.is_set() or self.flushing.is_set():
            raise RuntimeError("this manager was stopped; create a new one with init_continuous_batching")
        self._thread = threading.Thread(target=_run, args=(self, keep_alive), name="rollout-engine", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        """True while the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def on_thread(self) -> bool:
        """True when called on the engine thread (from a result handler)."""
        return threading.current_thread() is self._thread

    def stop(self, block: bool, timeout: float | None) -> None:
        """Make the loop end (at once when it never started), and wait for it unless on the engine thread."""
        self.stopping.set()
        self.commands.put(Wake())
        if self._thread is None:
            self.shutdown()
        elif block and not self.on_thread():  # from a handler: the loop ends after it
            self.join(timeout)

    def join(self, timeout: float | None) -> None:
        """Wait for the thread to end."""
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        """The thread's body: until the manager stops (or something fails), apply commands and step."""
        owner, engine = self.owner, self.engine
        try:
            while not self.stopping.is_set():
                if self.flushing.is_set() and (self.generation.holds or self._flushed()):
                    break
                idle = self.generation.holds or not engine.has_unfinished()
                self._drain_commands(block=idle and self.updates.pending is None)
                self.updates.try_apply()
                self.generation.advance()
                if not self.generation.holds and engine.has_unfinished():
                    started = time.perf_counter()
                    outputs = engine.step()
                    if owner.step_observer is not None:
                        owner.step_observer(time.perf_counter() - started)
                    self.deliver(outputs)
        except BaseException as error:  # noqa: BLE001 - report to every waiter instead of dying silently
            logger.exception("engine thread failed")
            owner.error = error
        finally:
            self.shutdown(reason=None if owner.error is None else f"engine thread failed: {owner.error!r}")

    def flush_and_stop(self) -> None:
        """End the loop once the groups added so far have finished (the manager refuses new ones already)."""
        self.flushing.set()
        self.commands.put(Wake())
        if self._thread is None:
            self.shutdown()

    def _flushed(self) -> bool:
        """Every group added was taken by the engine and has finished (engine thread)."""
        return self.requests.num_queued == 0 and self.commands.empty() and not self.engine.has_unfinished()

    def shutdown(self, reason: str | None = None) -> None:
        """Refuse new requests, end everything still queued or running, release the model."""
        with contextlib.suppress(ReferenceError):  # (a manager dropped unstopped: nobody reads its uptime)
            if self.owner.stopped_at is None:
                self.owner.stopped_at = time.time()
        self.requests.close()
        self.updates.refuse_pending("the manager stopped before the weight update was applied")
        self.generation.refuse_waiting("the manager stopped before the in-flight samples finished")
        for command in drain(self.commands):
            if isinstance(command, AddGroup):
                self._end_unstarted(command.request, "abort" if reason is None else "error", reason)
            elif isinstance(command, ApplyWeights):
                command.update.callback(RuntimeError("the manager stopped before the weight update was applied"))
            elif isinstance(command, PauseLoop):
                PauseGate.refuse(command.request, "the manager stopped before the loop paused")
            elif isinstance(command, (GenerationPauseCommand, EngineCall)):
                command.reply.put(RuntimeError("the manager stopped"))
        try:
            self.deliver(self.engine.flush())  # the step still on the device ends first
        except Exception:  # noqa: BLE001 - shutting down: what is left is ended below either way
            logger.exception("could not finish the last engine step")
        outputs = self.engine.cancel(*self.engine.open_group_ids())
        if reason is not None:
            for output in outputs:
                output.finish_reason, output.error = "error", reason
        self.deliver(outputs)
        self.engine.close()
        with self.lock:
            self.lock.notify_all()

    def _drain_commands(self, block: bool) -> None:
        started = time.perf_counter()
        commands = drain(self.commands, wait_s=0.5 if block else None)
        if block:  # nothing to run: the engine was idle while it waited
            self.owner.idle_s += time.perf_counter() - started
        cancels: list[str] = []  # consecutive cancels end together: one pass over the queues, not one per group
        for command in commands:
            if isinstance(command, CancelGroup):
                cancels.append(command.group_id)
                continue
            if cancels:
                self.deliver(self.engine.cancel(*cancels))
                cancels = []
            self._apply(command)
        if cancels:
            self.deliver(self.engine.cancel(*cancels))

    def _apply(self, command: Command) -> None:
        if isinstance(command, AddGroup):
            self.requests.taken()
            try:
                self.engine.submit(command.request)
            except AdapterUnloaded as error:  # unloaded while this group was queued: it ends as the unload's others
                self._end_unstarted(command.request, "abort", str(error))
            except FieldError as error:  # e.g. its id is still running in the engine: the caller still hears back
                self._end_unstarted(command.request, "error", str(error.renamed(TRANSFORMERS_FIELD_NAMES)))
        elif isinstance(command, PauseLoop):
            PauseGate.serve(command.request, self.stopping.is_set(), lambda: self.deliver(self.engine.flush()))
            self.engine.weights_changed()  # the pause's holder may have changed the model in place
        elif isinstance(command, ApplyWeights):
            self.updates.take(command.update)
        elif isinstance(command, GenerationPauseCommand):
            self.generation.apply(command)
        elif isinstance(command, EngineCall):
            try:
                self.deliver(self.engine.flush())
                answer = command.function(self.engine)
            except Exception as error:  # noqa: BLE001 - the caller hears of it; the loop goes on
                answer = error
            try:
                command.reply.put(answer)  # once (an `AnswerTo` calls back)
            finally:  # a raised answer's traceback holds this frame: not the answer too
                answer = None

    def _end_unstarted(self, request: Request, reason: str, error: str | None) -> None:
        """Final outputs for a group the engine never took (refused late, or the manager stopped first)."""
        self.deliver(never_started(request, reason, error))


def _run(loop: EngineLoop, keep_alive: object) -> None:
    """The engine thread's target: the loop's body, with the manager held (`keep_alive`) while it runs."""
    try:
        loop.run()
    finally:  # the manager's `error` (its traceback) holds this frame: not the manager too
        del keep_alive
