"""Weight updates on their way to the engine thread: queued by any thread, applied by the engine thread between
two steps, at once or, for mode "wait", once in-flight samples drained (admission paused meanwhile). An update is
either applied and reported, or never applied: a waiter that gives up cancels it under the manager's lock.

Updates apply one at a time, in the order they arrived: one that arrives while another waits (for in-flight samples
to drain, mode "wait") waits behind it, as two pushes from two clients would expect."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from rollout.config import WEIGHT_UPDATE_MODES, FieldError
from rollout.engine.engine import Engine
from rollout.engine.lora.adapter_weights import (
    check_served_base,
    from_named_tensors,
    from_peft_model,
    load_peft_dir,
    split_adapter_tensors,
    to_named_tensors,
)
from rollout.engine.manager.commands import AdapterUpdate, ApplyWeights, Command, PendingUpdate
from rollout.engine.requests.adapter_ref import check_adapter_name
from rollout.engine.requests.outputs import GenerationOutput
from rollout.engine.weights.weight_table import WeightUpdateResult


class WeightUpdateQueue:
    """The manager's pending weight update and what the newest applied one did."""

    def __init__(
        self,
        engine: Engine,
        lock: threading.Condition,
        post: Callable[[Command], None],
        deliver: Callable[[list[GenerationOutput]], None],
        is_running: Callable[[], bool],
        is_closed: Callable[[], bool],
        paused_here: Callable[[], bool],
        generation_held: Callable[[], bool] = lambda: False,
    ):
        """
        Args:
            engine: the engine the updates go into.
            lock: the manager's lock (an update's state changes under it).
            post: puts a command in the engine thread's mailbox.
            deliver: hands outputs (of aborted samples) to their readers.
            is_running: whether the engine thread runs (else updates apply in the caller's thread).
            is_closed: whether the manager stopped taking work.
            paused_here: whether the calling thread holds the manager's pause (then waiting for an update would
                wait forever: the loop applies it only after the pause).
            generation_held: whether a generation pause holds the loop (then a "wait" update, which needs the
                samples in flight to finish, is refused instead of waiting for a resume).
        """
        self.engine = engine
        self._lock = lock
        self._post = post
        self._deliver = deliver
        self._is_running = is_running
        self._is_closed = is_closed
        self._paused_here = paused_here
        self._generation_held = generation_held
        self.queued: deque[PendingUpdate] = deque()  # engine thread only: the first is the one being applied
        self.last_result: WeightUpdateResult | None = None
        self.last_at: float | None = None  # unix time

    def submit(
        self,
        tensors: dict[str, torch.Tensor],
        version: int | None,
        mode: str,
        partial: bool,
        drain_timeout: float | None,
        callback: Callable[[WeightUpdateResult | BaseException], None],
        adapter: AdapterUpdate | None = None,
    ) -> PendingUpdate | None:
        """Queue a weight update for the engine thread; `callback` gets the `WeightUpdateResult` or the exception
        (on the engine thread, or at once when the update is refused). Arguments as for `update_weights`; with
        `adapter`, `tensors` are a LoRA adapter's, wire-named (`Engine.load_adapter`).

        Returns:
            The queued update (its `state` says whether it was applied), or None when it was refused at once.
        """
        if mode not in WEIGHT_UPDATE_MODES:
            callback(FieldError("mode", f"must be one of {list(WEIGHT_UPDATE_MODES)}, got {mode!r}"))
            return None
        deadline = None if drain_timeout is None else time.monotonic() + drain_timeout
        update = PendingUpdate(tensors, version, mode, partial, callback, deadline, time.monotonic(), adapter)
        with self._lock:
            if self._is_closed():
                callback(RuntimeError("the manager is stopped"))
                return None
            if not self._is_running():  # nothing else touches the engine: apply here
                self.queued.append(update)
                self.try_apply()
                return update
            self._post(ApplyWeights(update))
        return update

    @property
    def pending(self) -> PendingUpdate | None:
        """The update that applies next (engine thread), or None."""
        return self.queued[0] if self.queued else None

    def try_apply(self) -> None:
        """Engine thread: apply the queued updates in order, each once nothing it must wait for is in flight."""
        while self.queued and self._try_first():
            pass

    def _try_first(self) -> bool:
        """Apply (or drop) the first queued update if it can be now; whether it left the queue."""
        update = self.queued[0]
        with self._lock:
            if update.state == "cancelled":  # its waiter gave up: never apply it
                self.queued.popleft()
                self.engine.resume_admission()
                return True
        waits = update.mode == "wait"
        if waits and self.engine.num_in_flight():
            if self._generation_held():
                self.queued.popleft()
                count = self.engine.num_in_flight()
                reason = f"'wait' cannot drain while generation is paused ({count} samples held): resume first"
                update.callback(FieldError("mode", reason + ", or commit with keep, recompute or abort"))
                return True
            if update.drain_deadline is not None and time.monotonic() > update.drain_deadline:
                self.queued.popleft()
                self.engine.resume_admission()
                count = self.engine.num_in_flight()
                update.callback(TimeoutError(f"'wait' update dropped: {count} samples still in flight at its deadline"))
                return True
            self.engine.pause_admission()
            return False
        with self._lock:
            if update.state == "cancelled":
                self.queued.popleft()
                self.engine.resume_admission()
                return True
            update.state = "applying"
        self.queued.popleft()
        drain_ms = (time.monotonic() - update.received) * 1000 if waits else 0.0
        try:
            result = self._apply(update)
        except Exception as error:  # noqa: BLE001 - a refused update goes back to its sender
            outcome: WeightUpdateResult | BaseException = error
        else:
            result.drain_ms = drain_ms
            outcome = result
            self.last_result, self.last_at = result, time.time()
            self._deliver(result.outputs)
        finally:
            self.engine.resume_admission()
        try:
            update.callback(outcome)
        finally:  # a refused update's traceback keeps this frame: not the error too (a cycle holding the manager)
            outcome = None
        return True

    def _apply(self, update: PendingUpdate) -> WeightUpdateResult:
        if update.adapter is None:
            return self.engine.update_weights(update.tensors, update.version, update.mode, update.partial)
        adapter, base = split_adapter_tensors(update.tensors, update.adapter.scalings)
        modules = from_named_tensors(adapter, update.adapter.scalings)
        return self.engine.load_adapter(update.adapter.name, modules, update.version, update.mode, base=base)

    def apply(
        self,
        tensors: dict[str, torch.Tensor],
        version: int | None,
        mode: str,
        partial: bool,
        timeout: float | None,
        adapter: AdapterUpdate | None = None,
    ) -> WeightUpdateResult:
        """Submit an update and wait for its outcome (arguments as for `ContinuousBatchingManager.update_weights`).
        A waiter that gives up first cancels it under the lock, so it is never applied late.

        Raises:
            The update's error; TimeoutError when it was not applied in time; RuntimeError inside this thread's
            pause, or once the manager stopped.
        """
        self._refuse_inside_pause("a weight update" if adapter is None else "an adapter")
        done: queue.SimpleQueue = queue.SimpleQueue()
        update = self.submit(tensors, version, mode, partial, timeout, done.put, adapter)
        try:
            outcome = done.get(timeout=None if timeout is None else timeout + 5.0)
        except queue.Empty:
            with self._lock:
                if update is not None and update.state == "pending":
                    update.state = "cancelled"  # the engine thread will skip it: nothing changes
                    raise TimeoutError(f"the weight update was not applied within {timeout} s") from None
            outcome = done.get()  # being applied right now: a copy, so this returns promptly
        if isinstance(outcome, BaseException):
            try:
                raise outcome
            finally:  # the traceback keeps this frame, not the error: no cycle to collect
                outcome = None
        return outcome

    def apply_adapter(
        self, name: str, adapter: Any, version: int | None, mode: str, timeout: float | None
    ) -> WeightUpdateResult:
        """Load an adapter (`adapter_update`'s forms) and wait for it, as `apply` (arguments as for
        `ContinuousBatchingManager.load_adapter`)."""
        self._refuse_inside_pause("an adapter")
        if not isinstance(adapter, (str, dict)):
            check_served_base(adapter, self.engine.model)
        tensors, update = adapter_update(name, adapter, getattr(self.engine.model, "name_or_path", None))
        return self.apply(tensors, version, mode, False, timeout, update)

    def _refuse_inside_pause(self, what: str) -> None:
        if self._paused_here():
            raise RuntimeError(
                f"cannot wait for {what} inside this thread's pause: the loop applies it only after the pause "
                "(copy the tensors into the model directly while paused, or update after the `with` block)"
            )

    def take(self, update: PendingUpdate) -> None:
        """Engine thread: an `ApplyWeights` command arrived; it applies after those queued before it."""
        if update.state != "cancelled":
            self.queued.append(update)

    def refuse_pending(self, reason: str) -> None:
        """Engine thread, at shutdown: the queued updates are never applied."""
        while self.queued:
            self.queued.popleft().callback(RuntimeError(reason))


def adapter_update(
    name: str, adapter: Any, served_base: str | None = None
) -> tuple[dict[str, torch.Tensor], AdapterUpdate]:
    """An adapter as `ContinuousBatchingManager.load_adapter` takes it, as wire-named tensors and the update's
    name and scalings.

    Args:
        name: the adapter's name (checked).
        adapter: a PEFT adapter directory, a `peft.PeftModel` (its active adapter; its tensors are copied now), or
            base module name -> `LoraModule` / `SavedModule`.
        served_base: the served model's `name_or_path`, for a directory's `base_model_name_or_path` to be checked
            against (`load_peft_dir`).
    Raises:
        FieldError: a bad name or adapter (named).
    """
    check_adapter_name(name, "name")
    if isinstance(adapter, str):
        modules = load_peft_dir(adapter, served_base)
    elif isinstance(adapter, dict):
        modules = adapter
    else:
        modules = from_peft_model(adapter)
    tensors, scalings = to_named_tensors(modules)
    if not isinstance(adapter, (str, dict)):  # a live model's own tensors: copies, taken now
        tensors = {name: tensor.clone() for name, tensor in tensors.items()}
    return tensors, AdapterUpdate(name, scalings)
