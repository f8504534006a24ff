"""Which workers a `RolloutClient` uses and which of them answer: their addresses, adding and removing one, waiting
for them to answer once, and why none serves (what a timeout's message adds). `RolloutClient` inherits it; the I/O
thread (dispatcher.py) owns the workers' state, read here from the caller's thread as a snapshot."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from rollout.protocol.sockets import check_address
from rollout.validation import is_seconds
from trainer_bridge.client.calls import RolloutError
from trainer_bridge.client.closing_waits import SLICE_S
from trainer_bridge.client.commands import AddWorker, RemoveWorker
from trainer_bridge.client.routing import stale_workers


def worker_address_problem(address: str) -> str | None:
    """What is wrong with a worker address to connect to (None: nothing).

    Args:
        address: a worker's address as a caller gave it ("tcp://host:port").
    """
    problem = check_address(address)
    if problem is None and address.startswith("tcp://") and address.rpartition(":")[2] == "*":
        problem = f"{address}: a worker's address names its port (* is for binding)"
    return problem


def check_wait(timeout: Any, inf: bool = False) -> None:
    """Refuse a wait's timeout that is not None or a number of seconds >= 0 (NaN passed no deadline: the wait
    returned at once as if it had timed out; a string failed with a TypeError).

    Args:
        timeout: what the caller gave.
        inf: math.inf counts too (a wait bounded otherwise: wait_connected's connect_timeout).
    Raises:
        RolloutError: "bad_request", naming the field "timeout".
    """
    if timeout is not None and not is_seconds(timeout, zero=True, inf=inf):
        raise RolloutError(
            "bad_request", f"timeout must be None or a number of seconds >= 0, got {timeout!r}", "timeout"
        )


class WorkerMembership:
    """The worker-set half of `RolloutClient` (which sets `_io`, `_closed`, `_started` and `connect_timeout`)."""

    _io: Any  # the client's Dispatcher
    _closed: threading.Event
    _started: float
    connect_timeout: float
    dead_after_s: float
    min_policy_version: int

    @property
    def worker_addresses(self) -> list[str]:
        """The address of every worker this client uses (removed ones left out), in the order they were given."""
        return [worker.address for worker in self._io.workers if not worker.retired]

    def worker_address(self, index: int) -> str:
        """The address of worker `index` (an index of `live_workers()`; a removed worker keeps its index)."""
        return self._io.workers[index].address

    def add_worker(self, address: str, timeout: float = 10.0) -> None:
        """Use one more worker (nothing when this client already uses one at `address`). It gets groups once it
        answered and serves the newest weights pushed through this client.

        Args:
            address: the worker's address ("tcp://host:port"), with the same keys as the others.
            timeout: most seconds to wait for the I/O thread to take it.
        """
        problem = worker_address_problem(address)
        if problem is not None:
            raise ValueError(f"address: {problem}")
        command = AddWorker(address, threading.Event())
        self._membership(command, timeout)
        if command.error is not None:
            raise ValueError(f"address: {command.error}")

    def remove_worker(self, address: str, timeout: float = 10.0) -> None:
        """Stop using the worker at `address` (nothing when none): its unfinished groups are resubmitted to the
        others (and cancelled on it), an open weight push goes on without it. Returns once it is out.

        Args:
            address: the worker's address, as given.
            timeout: most seconds to wait for the I/O thread to take it out.
        """
        self._membership(RemoveWorker(address, threading.Event()), timeout)

    def _membership(self, command: AddWorker | RemoveWorker, timeout: float) -> None:
        if self._closed.is_set():
            raise RolloutError("closed", "the client is closed")
        self._io.command(command)
        deadline = time.monotonic() + timeout
        while not command.done.wait(min(SLICE_S, max(0.0, deadline - time.monotonic()))):
            if self._closed.is_set():  # closed meanwhile: its I/O thread ended, maybe before taking the command
                raise RolloutError("closed", "the client was closed")
            if time.monotonic() >= deadline:
                raise RolloutError("timeout", f"the client's I/O thread did not take {command.address} in time")

    def wait_connected(self, timeout: float | None = None) -> list[int]:
        """Wait until every worker answered once (or refused this client), at most until `connect_timeout` after
        this client was made or `timeout` seconds; return `live_workers()`. Calls need not wait: groups wait for
        a worker by themselves. `push_weights` waits, to reach every worker that is up.

        Args:
            timeout: most seconds to wait (default: what is left of connect_timeout).
        Raises:
            RolloutError: "closed" on a closed client, or one closed while it waits (no worker would ever answer
                it); "bad_request" for a timeout
                that is no number of seconds >= 0.
        """
        if self._closed.is_set():
            raise RolloutError("closed", "the client is closed")
        check_wait(timeout, inf=True)  # (math.inf waits as long as connect_timeout lets it, as it always did)
        added = [worker.added_at for worker in self._io.workers if not worker.retired]
        deadline = min(
            max(added, default=self._started) + self.connect_timeout,  # a worker added later gets its own time
            time.monotonic() + (self.connect_timeout if timeout is None else timeout),
        )
        while time.monotonic() < deadline and not self._closed.is_set():
            # Settled: refused, alive, or answered once and now down (no connection, or silent over one: frozen). A
            # worker that is not up yet, or reconnected but has not answered yet, is waited for.
            if all(
                w.retired or w.refused or w.alive or (w.answered and (w.silent or not w.connected))
                for w in self._io.workers
            ):
                break
            time.sleep(0.005)
        if self._closed.is_set():  # closed while waiting: no worker will answer (not "none answered")
            raise RolloutError("closed", "the client was closed")
        return self.live_workers()

    def outage(self, calls: Iterable[Any] = ()) -> str | None:
        """Why no worker serves this client now, each worker named (None while one does and holds none of `calls`):
        what a timeout adds to its message, so that a trainer whose only worker died reads which one, and since
        when, one whose live workers all serve weights older than its last push reads which, at which versions
        (`stale_workers`), and one whose groups wait on a live worker reads which, and whether it answers pings.

        Args:
            calls: the calls the timed-out caller waited for (their workers are named).
        """
        workers = [worker for worker in self._io.workers if not worker.retired]
        if any(worker.alive for worker in workers):  # (read from the caller's thread: a snapshot, as below)
            return stale_workers(workers, self.min_policy_version) or self._holders(calls)
        now = time.monotonic()
        states = []
        for worker in workers:
            if worker.lost is not None:
                why, since = worker.lost
                states.append(f"{worker.address}: lost {now - since:.0f} s ago ({why})")
            else:
                states.append(f"{worker.address}: {worker.refused or worker.unverified or 'never answered'}")
        return "no rollout worker serves (" + "; ".join(states) + ")" if states else "the client has no worker"

    def _holders(self, calls: Iterable[Any]) -> str | None:
        """The live workers `calls` wait on, each with whether it answers pings (None: no call is on a worker)."""
        now, named = time.monotonic(), []
        for index in dict.fromkeys(call.worker for call in calls if call.worker is not None):
            worker = self._io.workers[index]
            since = worker.unanswered_since
            if since is not None and now - since >= 1.0:  # (a worker that serves answers a ping in milliseconds)
                state = (
                    f"it has not answered pings for {now - since:.1f} s: stopped or stalled? (declared dead, and "
                    f"its groups resubmitted, after dead_after_s={self.dead_after_s:g} s)"
                )
            else:
                state = "it answers pings: still generating (raise the timeout for long groups)"
            named.append(f"{worker.address} ({state})")
        return "waiting on " + "; ".join(named) if named else None

    def live_workers(self) -> list[int]:
        """Indices of the workers that answered and are not declared dead."""
        return [index for index, worker in enumerate(self._io.workers) if worker.alive]
