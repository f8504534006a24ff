"""The manager's engine thread: it applies the commands other threads left in its mailbox, applies a weight update
when one can go in, steps the engine and delivers the outputs; when the manager stops (or the thread fails) it
refuses what is still queued, ends what runs and gives the model back."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from rollout.config import FieldError
from rollout.engine.manager.commands import AddGroup, ApplyWeights, CancelGroup, Command, PauseLoop
from rollout.engine.manager.pause import PauseGate
from rollout.engine.requests.intake import TRANSFORMERS_FIELD_NAMES
from rollout.engine.requests.outputs import never_started
from rollout.engine.requests.request import Request
from rollout.mailbox import drain

logger = logging.getLogger("rollout.engine.manager.continuous_batching")


class LoopOwner(Protocol):
    """What the loop uses of its `ContinuousBatchingManager` (structural: this module does not import the manager)."""

    engine: Any
    error: BaseException | None
    idle_s: float
    step_observer: Callable[[float], None] | None
    _stop: Any  # threading.Event
    _state: Any  # threading.Condition
    _closed: bool
    _commands: Any  # the engine thread's mailbox
    _num_queued: int
    _updates: Any  # WeightUpdateQueue

    def _deliver(self, outputs: list[Any]) -> None: ...


class EngineLoop:
    """The engine side of a `ContinuousBatchingManager` (it shares the manager's lock, mailbox and state)."""

    def __init__(self, manager: LoopOwner):
        self.manager = manager

    def run(self) -> None:
        """The thread's body: until the manager stops (or something fails), apply commands and step."""
        try:
            while not self.manager._stop.is_set():
                self._drain_commands(
                    block=not self.manager.engine.has_unfinished() and self.manager._updates.pending is None
                )
                self.manager._updates.try_apply()
                if self.manager.engine.has_unfinished():
                    started = time.perf_counter()
                    outputs = self.manager.engine.step()
                    if self.manager.step_observer is not None:
                        self.manager.step_observer(time.perf_counter() - started)
                    self.manager._deliver(outputs)
        except BaseException as error:  # noqa: BLE001 - report to every waiter instead of dying silently
            logger.exception("engine thread failed")
            self.manager.error = error
        finally:
            self.shutdown(
                reason=None if self.manager.error is None else f"engine thread failed: {self.manager.error!r}"
            )

    def shutdown(self, reason: str | None = None) -> None:
        """Refuse new requests, end everything still queued or running, release the model."""
        with self.manager._state:
            self.manager._closed = True
        self.manager._updates.refuse_pending("the manager stopped before the weight update was applied")
        for command in drain(self.manager._commands):
            if isinstance(command, AddGroup):
                self._end_unstarted(command.request, "abort" if reason is None else "error", reason)
            elif isinstance(command, ApplyWeights):
                command.update.callback(RuntimeError("the manager stopped before the weight update was applied"))
            elif isinstance(command, PauseLoop):
                PauseGate.refuse(command.request, "the manager stopped before the loop paused")
        try:
            self.manager._deliver(self.manager.engine.flush())  # the step still on the device ends first
        except Exception:  # noqa: BLE001 - shutting down: what is left is ended below either way
            logger.exception("could not finish the last engine step")
        for group_id in self.manager.engine.open_group_ids():
            outputs = self.manager.engine.cancel(group_id)
            if reason is not None:
                for output in outputs:
                    output.finish_reason, output.error = "error", reason
            self.manager._deliver(outputs)
        self.manager.engine.close()
        with self.manager._state:
            self.manager._state.notify_all()

    def _drain_commands(self, block: bool) -> None:
        started = time.perf_counter()
        commands = drain(self.manager._commands, wait_s=0.5 if block else None)
        if block:  # nothing to run: the engine was idle while it waited
            self.manager.idle_s += time.perf_counter() - started
        for command in commands:
            self._apply(command)

    def _apply(self, command: Command) -> None:
        if isinstance(command, AddGroup):
            with self.manager._state:
                self.manager._num_queued -= 1
            try:
                self.manager.engine.submit(command.request)
            except FieldError as error:  # e.g. its id is still running in the engine: the caller still hears back
                self._end_unstarted(command.request, "error", str(error.renamed(TRANSFORMERS_FIELD_NAMES)))
        elif isinstance(command, CancelGroup):
            self.manager._deliver(self.manager.engine.cancel(command.group_id))
        elif isinstance(command, PauseLoop):
            PauseGate.serve(
                command.request, self.manager._stop.is_set(), lambda: self.manager._deliver(self.manager.engine.flush())
            )
            self.manager.engine.weights_changed()  # the pause's holder may have changed the model in place
        elif isinstance(command, ApplyWeights):
            self.manager._updates.take(command.update)

    def _end_unstarted(self, request: Request, reason: str, error: str | None) -> None:
        """Final outputs for a group the engine never took (refused late, or the manager stopped first)."""
        self.manager._deliver(never_started(request, reason, error))
