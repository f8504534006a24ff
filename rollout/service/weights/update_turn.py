"""Who holds a worker's one weight-update slot: a new `weights_begin` against the update open (`begin_conflict`),
and an update committed outside ZeroMQ (the HTTP API's /update_weights or /v1/load_lora_adapter, from its own
thread) against both (`UpdateTurn`). One weight update at a time, whichever way it comes: a checkpoint or adapter
committed beside an open push would take the version that push is about to commit."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from rollout.service.weights.staged_update import StagedUpdate


def begin_conflict(update: StagedUpdate, identity: bytes, preempt: bool) -> tuple[bool, str]:
    """What a new `weights_begin` does to the open `update`: (True, why the open one is rejected) when the begin
    takes the slot over, (False, why the begin is refused) when it cannot.

    Args:
        update: the update open.
        identity: the new begin's sender.
        preempt: the new begin asks to take the slot over from another client (`push_weights(..., preempt=True)`).
    """
    if update.committing:
        return False, f"update {update.update_id!r} is being committed; begin again once it is"
    if update.identity == identity:  # the same client begins again: it abandoned its open update
        return True, "replaced by a newer weights_begin of this client"
    if preempt:
        return True, "another trainer took the update slot over (preempt)"
    return False, (
        f"update {update.update_id!r} of another client is still open (one at a time: push again once it "
        "ends, or take the slot over with push_weights(..., preempt=True), the protocol's weights_begin preempt)"
    )


class UpdateTurn:
    """The slot held by an update committed outside ZeroMQ, named by its directory. Its lock orders that take (any
    thread) against a ZeroMQ begin (the serving thread): neither sees the slot free while the other takes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outside: str | None = None

    def take_outside(self, directory: str, open_update: Callable[[], StagedUpdate | None]) -> str | None:
        """Hold the slot for an update from `directory` until `end_outside` (any thread).

        Args:
            directory: what the update commits, named to a ZeroMQ begin refused meanwhile.
            open_update: the ZeroMQ update open (None: none), read under the lock.
        Returns:
            None when the slot is now held; else why not (a ZeroMQ update is open, or another held it).
        """
        with self._lock:
            update = open_update()
            if update is not None:
                return (
                    f"ZeroMQ weight update {update.update_id!r} is open (one weight update at a time, whichever "
                    "way it comes): send this once it ends"
                )
            if self._outside is not None:  # another taker outside ZeroMQ (the HTTP routes queue on one lock)
                return f"a weight update from {self._outside!r} is being committed over HTTP: send this once it is"
            self._outside = directory
            return None

    def end_outside(self) -> None:
        """Free the slot `take_outside` held (any thread)."""
        with self._lock:
            self._outside = None

    @contextlib.contextmanager
    def inside(self) -> Iterator[str | None]:
        """Hold the lock while a ZeroMQ update may begin: yields why it may not (an update committing outside
        ZeroMQ), else None."""
        with self._lock:
            if self._outside is None:
                yield None
                return
            yield (
                f"a weight update from {self._outside!r} (the HTTP API's /update_weights or /v1/load_lora_adapter) "
                "is being committed; begin again once it is"
            )
