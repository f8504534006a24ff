"""`adapter_unload` on the ZeroMQ worker: a served LoRA adapter stops serving. The unload runs on the engine thread
between two steps (`ServingControl.submit_unload_adapter`); its answer goes out from the serving thread
(`conclude`), which never waits for it. Unloads do not take the update slot: they copy no bytes, and an update open
meanwhile goes on (one that commits an adapter of that name then serves it again)."""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable

from rollout import protocol as p
from rollout.config import FieldError
from rollout.engine.manager.continuous_batching import ContinuousBatchingManager
from rollout.mailbox import drain

logger = logging.getLogger(__name__)


class AdapterUnloads:
    """The worker's adapter unloads in flight. Serving thread only, except the engine thread's answers."""

    def __init__(self, manager: ContinuousBatchingManager, send: Callable[..., None], wake: Callable[[], None]):
        """
        Args:
            manager: the engine manager that serves the adapters.
            send: how a reply reaches a client (identity, message, and the key it is for).
            wake: wakes the serving thread once the engine thread answered.
        """
        self.manager = manager
        self._send = send
        self._wake = wake
        # Answers from the engine thread: (identity, key, reply), sent by the serving thread (`conclude`).
        self._answers: queue.SimpleQueue[tuple[bytes, str | None, p.Message]] = queue.SimpleQueue()

    def handle(self, identity: bytes, message: p.AdapterUnload, key: str | None = None) -> None:
        """Start unloading `message.adapter`; its answer (adapter_unloaded, or an error naming `adapter`) comes back
        through `conclude`.

        Args:
            identity: the sender.
            message: the adapter_unload.
            key: the sender's CurveZMQ key (None: keys off); the answer goes only to it.
        """
        name, update_id = message.adapter, message.update_id

        def done(outcome: int | BaseException) -> None:  # on the engine thread
            if isinstance(outcome, FieldError):
                reply: p.Message = p.Error("bad_request", str(outcome), "adapter", None, update_id)
            elif isinstance(outcome, BaseException):
                reply = p.Error("internal", f"{type(outcome).__name__}: {outcome}", None, None, update_id)
            else:
                logger.info("LoRA adapter %r unloaded (adapter_unload; %d samples aborted)", name, outcome)
                reply = p.AdapterUnloaded(update_id, name, outcome)
            self._answers.put((identity, key, reply))
            self._wake()

        self.manager.control.submit_unload_adapter(name, done)

    def conclude(self) -> None:
        """Send the answers the engine thread gave since the last call."""
        for identity, key, reply in drain(self._answers):
            self._send(identity, reply, key)
