"""Which worker a group goes to, and the calls that wait for one (parked): the `CallRouter` the client's I/O thread
(`Dispatcher`) holds; only that thread calls it.

A group goes to the live worker with the least outstanding work among those that serve the newest weights pushed
through the client (`min_policy_version`): a worker that restarted, joined or missed a push serves older weights and
gets no group until it is brought up to date (by a push, or by a `RolloutFleet` from a peer). Calls wait (parked)
while no such worker is alive: for the first workers to answer, for a dead one to come back, for a stale one to be
updated. They fail, naming why, once none can come: no worker answered within `connect_timeout`, every worker refused
this client's key, or live workers stayed behind the newest version for `connect_timeout`.
"""

from __future__ import annotations

import secrets
import time

import zmq

from rollout import protocol as p
from trainer_bridge.client.affinity import PrefixAffinity
from trainer_bridge.client.calls import Call, RolloutError, retry_wire_id
from trainer_bridge.client.links import UNKNOWN_VERSION, WorkerLink

# Once the first worker answered, calls submitted before wait this long for the others to answer too.
FIRST_CONTACT_GRACE_S = 2.0


class CallRouter:
    """The calls in flight (by group id and by wire id), the parked ones, and where each goes."""

    def __init__(self, workers: list[WorkerLink], connect_timeout: float, heartbeat_s: float):
        """
        Args:
            workers: the client's worker links (the dispatcher's own list: workers it adds later are seen here).
            connect_timeout: how long calls wait for a first answer, or for a stale worker to be brought up to date.
            heartbeat_s: seconds between pings (the loop sleeps at most half of it).
        """
        self.workers = workers
        self.connect_timeout = connect_timeout
        self.heartbeat_s = heartbeat_s
        self.session = secrets.token_hex(16)  # `Generate.session`: this client's drafts are its own on every worker
        # The newest policy version pushed through this client (push_weights sets it): groups go to workers that
        # serve at least this one whenever one is alive.
        self.min_policy_version = 0
        self.affinity: PrefixAffinity | None = None  # prefix-affine routing (None: by load alone)
        self.first_answer_at: float | None = None  # when the first worker answered
        self.calls: dict[str, Call] = {}  # group id -> call
        self.by_wire: dict[str, Call] = {}  # wire id -> call
        self.parked: list[Call] = []  # calls waiting for any worker to be alive
        self._stale_since: float | None = None  # since when every live worker serves weights older than the newest

    def add(self, call: Call) -> None:
        """Track a new call and send it to a worker (or park it)."""
        self.calls[call.group.group_id] = call
        self.dispatch(call)

    def dispatch(self, call: Call) -> None:
        current = [
            index
            for index, worker in enumerate(self.workers)
            if worker.alive and worker.policy_version >= self.min_policy_version
        ]
        if not current:  # wait for a worker to come (back) or be brought up to date; a deadline bounds the wait
            self.parked.append(call)
            return
        if self.affinity is None:
            index = min(current, key=lambda i: self.workers[i].outstanding)
        else:  # a prompt that extends a recent one: to the worker holding its prefix, unless it is much busier
            keys = self.affinity.keys(call.group)
            index = self.affinity.choose(keys, current, lambda i: self.workers[i].outstanding, call.cost)
            self.affinity.remember(keys, index)
        call.worker = index
        self.workers[index].outstanding += call.cost
        group = call.group
        self.by_wire.pop(call.wire_id, None)
        call.attempts += 1
        call.wire_id = group.group_id if call.attempts == 1 else retry_wire_id(group.group_id, call.attempts - 1)
        self.by_wire[call.wire_id] = call
        try:
            message = p.Generate(
                call.wire_id, group.prompt_ids, group.n, group.sampling, call.stream, group.adapter, self.session
            )
            frames = p.encode(message)
        except Exception as error:  # noqa: BLE001 - a value msgpack cannot carry fails this call, not the thread
            self.finish(call)
            call.events.put(RolloutError("bad_request", f"the group cannot be encoded: {error}"))
            return
        try:
            self.workers[index].socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the heartbeat will declare the worker dead and resubmit its groups

    def finish(self, call: Call) -> None:
        self.calls.pop(call.group.group_id, None)
        self.by_wire.pop(call.wire_id, None)
        if call.worker is not None:
            self.workers[call.worker].outstanding -= call.cost

    def unreachable(self) -> str | None:
        """Why no call can be served: every worker refused this client or none answered within connect_timeout
        (None while one answered, or the deadline has not passed)."""
        if self.first_answer_at is not None:  # a worker answered once: calls wait for one to be back (their timeout)
            return None
        workers = [worker for worker in self.workers if not worker.retired]
        now = time.monotonic()
        starting = any(now - worker.added_at <= self.connect_timeout for worker in workers)
        if workers and starting and not all(worker.refused for worker in workers):
            return None
        if not workers:
            return "the client has no rollout worker (every one was removed)"
        reasons = [
            f"{worker.address}: {worker.refused or worker.unverified or f'no answer within {self.connect_timeout:g} s'}"
            for worker in workers
        ]
        if all(worker.refused for worker in workers):  # each answered, and refused this client: its keys say why
            return "every rollout worker refused this client (" + "; ".join(reasons) + ")"
        return (
            "no rollout worker answered (" + "; ".join(reasons) + "). Is rollout-worker running at that address "
            "and port? If it is still starting, give RolloutClient a larger connect_timeout."
        )

    def _stale(self) -> str | None:
        """Why no call can be served although workers are alive: all of them served weights older than the newest
        pushed for longer than connect_timeout (None otherwise)."""
        reason = stale_workers(self.workers, self.min_policy_version)
        if not self.parked or reason is None:
            self._stale_since = None  # (counted only while calls wait: a new call gets the whole connect_timeout)
            return None
        now = time.monotonic()
        if self._stale_since is None:
            self._stale_since = now
        return None if now - self._stale_since <= self.connect_timeout else reason

    def fail_parked(self) -> bool:
        """Fail the calls waiting for a worker when none can serve them (`unreachable`, `_stale`); whether any was
        failed (the callers hold the reason, naming each worker)."""
        unreachable = self.unreachable()
        reason, code = (unreachable, "no_workers") if unreachable is not None else (self._stale(), "stale_workers")
        if reason is None or not self.parked:
            return False
        self._stale_since = None
        parked, self.parked = self.parked, []
        for call in parked:
            if self.calls.get(call.group.group_id) is call:
                self.finish(call)
                call.events.put(RolloutError(code, reason))
        return True

    def poll_ms(self) -> int:
        """How long the loop may sleep: half a heartbeat, or until parked calls' first-contact grace ends."""
        wait_s = self.heartbeat_s / 2
        if self.parked and self.first_answer_at is not None:
            wait_s = min(wait_s, max(0.0, self.first_answer_at + FIRST_CONTACT_GRACE_S - time.monotonic()))
        return int(wait_s * 1000) + 1

    def release_parked(self) -> None:
        """Dispatch the calls waiting for a worker. At first contact, wait up to FIRST_CONTACT_GRACE_S for the
        other workers to answer too, so that groups submitted before any answered are spread over all of them."""
        if not self.parked or self.first_answer_at is None:
            return
        if not any(worker.alive and worker.policy_version >= self.min_policy_version for worker in self.workers):
            return  # nobody to take them yet
        starting = [w for w in self.workers if not w.answered and not w.refused and not w.retired]
        if starting and time.monotonic() - self.first_answer_at < FIRST_CONTACT_GRACE_S:
            return
        parked, self.parked = self.parked, []
        for call in parked:
            if self.calls.get(call.group.group_id) is call:
                self.dispatch(call)


def stale_workers(workers: list[WorkerLink], min_version: int) -> str | None:
    """Why no live worker may take a group: every one serves weights older than `min_version`, each named with its
    version (None when one serves it, or none is alive). What a call fails with (code "stale_workers") after
    `connect_timeout`, and what a call's timeout says when it comes first (`RolloutClient.outage`).

    Args:
        workers: the client's worker links.
        min_version: the newest version pushed through the client.
    """
    live = [worker for worker in workers if worker.alive]
    if not live or any(worker.policy_version >= min_version for worker in live):
        return None
    served = ", ".join(f"{worker.address} (version {_version(worker.policy_version)})" for worker in live)
    return (
        f"every live rollout worker serves weights older than version {min_version}, the newest pushed through "
        f"this client: {served}. They restarted or missed a push since; push the weights again (push_weights) so "
        "they serve the trainer's policy."
    )


def _version(version: int) -> str:
    return "not known yet" if version == UNKNOWN_VERSION else str(version)
