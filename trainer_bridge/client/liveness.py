"""Which of the client's workers answer: pings, socket-monitor events, failover and coming back, as the client's I/O
thread keeps them (the `Liveness` its `Dispatcher` holds; only that thread calls it).

Every worker is pinged every `heartbeat_s`, dead ones too, so they can come back. One whose ping stays unanswered
for `dead_after_s` (frozen), or whose connection closes (died, restarted, or dropped this client: its groups are
gone there), is declared dead: its unfinished groups are resubmitted to the live ones (with their seeds, so a
stream skips what it delivered) and open weight updates go on without it. A dead worker that answers again is used
again, and the groups taken from it are cancelled there. A worker that refuses this client's key is marked refused.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable

from rollout import protocol as p
from trainer_bridge.client.calls import WorkerLost, aborted_result
from trainer_bridge.client.links import UNKNOWN_VERSION, WorkerLink
from trainer_bridge.client.routing import CallRouter

logger = logging.getLogger("trainer_bridge.client")  # the client's one logger, as the dispatcher's


class Liveness:
    """Pings, monitor events, failover and revival of the dispatcher's workers (see the module docstring)."""

    def __init__(
        self,
        workers: list[WorkerLink],
        router: CallRouter,
        channels: dict[str, queue.SimpleQueue],
        stats_sinks: list[deque[queue.SimpleQueue]],
        send: Callable[[int, p.Message], None],
        heartbeat_s: float,
        dead_after_s: float,
        connect_timeout: float,
    ):
        """
        Args:
            workers: the dispatcher's worker links (its own list: workers it adds later are seen here).
            router: the dispatcher's calls in flight; a dead worker's go back through it.
            channels: the open weight updates' reply queues, by update id (told of a worker lost).
            stats_sinks: per worker, the callers waiting for its stats (told "none" when it dies).
            send: sends a message to the worker of that index.
            heartbeat_s: seconds between pings to each worker.
            dead_after_s: a worker silent this long is dead; its groups go to the others.
            connect_timeout: a worker that never answered within this long is reported once.
        """
        self.workers = workers
        self.router = router
        self.channels = channels
        self.stats_sinks = stats_sinks
        self.send = send
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.connect_timeout = connect_timeout

    def on_monitor(self, index: int) -> None:
        """Socket monitor events: the connection closed (the worker died, restarted, or dropped this client: its
        groups are gone there, so they fail over at once), or the worker refused this client's handshake.

        Args:
            index: the worker whose monitor socket has events.
        """
        worker = self.workers[index]
        for kind, reason in worker.monitor_events():
            if kind == "connected":  # (re)connected: ask at once whether it serves
                worker.connected, worker.silent = True, False
                worker.last_ping = time.monotonic()
                self.send(index, p.Ping())
            elif kind == "unverified":
                worker.unverified = reason  # named if it never answers; cleared once it does
            elif kind == "disconnected":
                worker.connected = False
                # A worker that comes back may have restarted on other weights: no call goes to it before its
                # first pong says which it serves.
                worker.policy_version = UNKNOWN_VERSION
                if worker.alive:
                    worker.alive, worker.lost = False, ("its connection closed", time.monotonic())
                    logger.warning("connection to rollout worker %s closed; %s", worker.address, self._fate())
                    self.failover(index)
            else:
                if worker.refused != reason:
                    logger.error("rollout worker %s %s", worker.address, reason)
                worker.refused = reason
        self.router.fail_parked()

    def heartbeat(self) -> None:
        """Ping every worker (dead ones too, so they can come back); one whose ping stays unanswered for
        dead_after_s is declared dead and its groups move to the others. Fail parked calls once no worker can
        be reached."""
        now = time.monotonic()
        told = self.router.fail_parked()  # the failed callers' error names each silent worker: not said twice
        self.router.release_parked()
        for index, worker in enumerate(self.workers):
            if worker.retired:
                continue
            if not worker.answered and not worker.warned and now - worker.added_at > self.connect_timeout:
                worker.warned = True
                if not told:
                    logger.warning(
                        "rollout worker %s never answered within %g s (%s)",
                        worker.address,
                        self.connect_timeout,
                        worker.unverified or "not running, or a wrong address or port?",
                    )
            if (
                worker.alive
                and worker.unanswered_since is not None
                and now - worker.unanswered_since > self.dead_after_s
            ):
                worker.alive, worker.silent = False, True
                worker.lost = (f"it stopped answering pings for {self.dead_after_s:g} s", time.monotonic())
                logger.warning("rollout worker %s stopped answering; %s", worker.address, self._fate())
                self.failover(index)
            if now - worker.last_ping >= self.heartbeat_s:
                worker.last_ping = now
                if worker.unanswered_since is None:
                    worker.unanswered_since = now
                self.send(index, p.Ping())

    def ping_live(self) -> None:
        """Ping every live worker now (its pong brings its policy version), counted as a heartbeat's ping."""
        now = time.monotonic()
        for index, worker in enumerate(self.workers):
            if worker.alive and not worker.retired:
                worker.last_ping = now
                if worker.unanswered_since is None:
                    worker.unanswered_since = now
                self.send(index, p.Ping())

    def _fate(self) -> str:
        """What becomes of a dead worker's groups (for its warning)."""
        if any(worker.alive for worker in self.workers):
            return "resubmitting its groups to the other workers"
        return "no other worker serves: its groups wait for one to come back, up to their timeout"

    def failover(self, index: int) -> None:
        """Resubmit a dead worker's groups to the live ones (streams skip what they delivered); updates go on.

        Args:
            index: the worker declared dead (or removed).
        """
        worker = self.workers[index]
        for replies in self.channels.values():
            replies.put((index, WorkerLost(worker.address)))
        for call in [c for c in self.router.calls.values() if c.worker == index]:
            worker.outstanding -= call.cost
            worker.taken_away.add(call.wire_id)
            call.worker = None
            call.received = {}
            if call.cancelled:  # cancelled: nobody waits for a resubmission; the abort its cancel promised comes
                self.router.finish(call)  # now, from no worker (the cancel's answer, should it come, is ignored)
                call.events.put(aborted_result(call.group))
                continue
            self.router.dispatch(call)
        while self.stats_sinks[index]:  # stats asked of it will not come: its callers count it as none (a later
            self.stats_sinks[index].popleft().put(None)  # reply from the same address must not go to them)

    def revive(self, index: int) -> None:
        """A worker answered for the first time, or again after it was declared dead: cancel what it no longer
        owns, and give it the parked calls.

        Args:
            index: the worker that answered while not alive.
        """
        worker = self.workers[index]
        if worker.answered:
            logger.warning("rollout worker %s is answering again", worker.address)
        else:
            logger.info("connected to rollout worker %s", worker.address)
        worker.alive = worker.answered = True
        worker.refused, worker.unverified, worker.silent, worker.lost = None, None, False, None
        for group_id in worker.taken_away:
            self.send(index, p.Cancel(group_id))
        worker.taken_away.clear()
        if self.router.first_answer_at is None:
            self.router.first_answer_at = time.monotonic()
        self.router.release_parked()
