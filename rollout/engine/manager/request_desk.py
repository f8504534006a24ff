"""The manager's request desk: groups checked on the caller's thread (`RequestIntake.prepare` reads no mutable engine
state), then handed to the engine thread's mailbox, all or none; cancels likewise. It counts the groups on their way
(for `max_queue_size` and `stats()`) and refuses new ones once the manager stopped.

Invariant: a group is opened in the result router before its `AddGroup` command is posted, under the manager's lock,
so no output can arrive for a group its readers do not know yet."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from rollout.config import FieldError
from rollout.engine.manager.commands import AddGroup, CancelGroup, Command
from rollout.engine.manager.results import ResultRouter
from rollout.engine.requests.group_spec import GroupSpec
from rollout.engine.requests.intake import RequestIntake


class QueueFullError(RuntimeError):
    """Raised by `add_request` when `max_queue_size` requests are already waiting."""


class RequestDesk:
    """Adds and cancels a manager's groups (on the callers' threads)."""

    def __init__(
        self,
        intake: RequestIntake,
        num_waiting: Callable[[], int],
        max_queue_size: int,
        lock: threading.Condition,
        router: ResultRouter,
        commands: queue.SimpleQueue[Command],
    ):
        """
        Args:
            intake: the engine's request intake (checks and resolves a `GroupSpec`).
            num_waiting: the requests the engine holds queued.
            max_queue_size: most groups waiting, queued here or in the engine (0: no limit).
            lock: the manager's lock (the counts and the router change under it).
            router: where the groups' outputs go; a group is opened there before it is posted.
            commands: the engine thread's mailbox.
        """
        self.intake = intake
        self._num_waiting = num_waiting
        self.max_queue_size = max_queue_size
        self._lock = lock
        self._router = router
        self._commands = commands
        self.num_queued = 0  # groups added but not yet taken by the engine thread
        self.closed = False  # the manager stopped: nothing more is added
        self._next_id = 0

    def new_id(self) -> str:
        """A request id not generated before ("req_<n>")."""
        with self._lock:
            request_id, self._next_id = f"req_{self._next_id}", self._next_id + 1
        return request_id

    def add(self, specs: list[GroupSpec]) -> None:
        """Check every group, then queue them all, or none.

        Raises:
            FieldError: bad input, naming the field (with a batch, which prompt). QueueFullError: the queue cannot
                take them all. RuntimeError: the manager was stopped.
        """
        group_ids = [spec.group_id for spec in specs]
        if len(set(group_ids)) != len(group_ids):
            raise FieldError("group_id", "one distinct group id is needed per prompt")
        requests = []
        for index, spec in enumerate(specs):
            try:
                requests.append(self.intake.prepare(spec))
            except FieldError as error:
                if len(specs) == 1:
                    raise
                raise FieldError(error.field, f"prompt {index} of the batch: {error.reason}") from None
        with self._lock:
            if self.closed:
                raise RuntimeError("the manager is stopped; create a new one with init_continuous_batching")
            for group_id in group_ids:
                if self._router.is_open(group_id):
                    raise FieldError("group_id", f"{group_id!r} is already in use by an unfinished request")
            limit = self.max_queue_size
            if limit and self.num_queued + self._num_waiting() + len(requests) > limit:
                raise QueueFullError(f"queue full: max_queue_size={limit} requests are already waiting")
            for request in requests:
                self._router.open(request.group_id, request.num_forks + 1)
                self.num_queued += 1
                self._commands.put(AddGroup(request))

    def taken(self) -> None:
        """Engine thread: one queued group was handed to the engine."""
        with self._lock:
            self.num_queued -= 1

    def close(self) -> None:
        """Refuse every later group (the manager is stopping)."""
        with self._lock:
            self.closed = True

    def cancel(self, request_id: str) -> None:
        """Abort a request's group (any of its sample ids names it); unknown or finished ids are ignored."""
        group_id = self._router.group_of(request_id)
        if group_id is not None:
            self._commands.put(CancelGroup(group_id))
