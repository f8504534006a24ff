"""Which workers a fleet's clients use, kept true by a monitor thread on the driver.

Each worker sits in a slot (one bundle of a placement group). The monitor asks every slot's actor for its `info` every
`POLL_S`. A worker seen for the first time (launched, added, or restarted by Ray: a new process) joins: when it serves
weights older than the fleet's newest version, a healthy peer first copies its weights to it (`copy_weights_to`), and
only then is it added to the clients, so no group ever reaches it with old weights. A worker whose actor died leaves
the clients (they had already resubmitted its groups when its connection closed). The newest version is the highest
any client pushed (`min_policy_version`) or any joined worker served; every client learns it, so each routes only to
workers that serve it.

When no peer holds the newest version (they all restarted), the worker joins with what it has; the clients send it
nothing until the trainer's next push reaches it. A joined worker that missed a push (it joined while the push went
to the others, or was frozen through it) is caught up from a peer once it stayed behind for CATCH_UP_S with no push
open: it leaves the clients, takes the copy and joins again.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import ray

from trainer_bridge.client import RolloutClient

logger = logging.getLogger("rollout.ray")

POLL_S = 0.25  # between two rounds of info calls
# A joined worker behind the newest version this long, with no push open, is caught up from a peer (it joined while
# a push went to the others, or was frozen through one).
CONFIRM_S = 5.0  # how long a catch-up waits to confirm the worker it copies to still runs
CATCH_UP_S = 2.0
# While Ray restarts an actor its calls wait; calls that keep failing mean Ray gave up on it (restarts exhausted).
DEAD_AFTER_FAILURES = 3
# "The actor is restarting" (Ray >= 2.30 names it; older versions make calls wait instead).
_RESTARTING = getattr(ray.exceptions, "ActorUnavailableError", ())


@dataclass
class Slot:
    """One worker of the fleet: its actor and where it is placed."""

    actor: Any  # the Ray actor handle (the same across Ray's restarts)
    group: Any  # its placement group
    bundle: int  # its bundle in the group
    info: dict[str, Any] | None = None  # the current process's last info (address, version, http, pid, started_at)
    joined: str | None = None  # the address the clients use for it; None while it is not serving
    pending: Any = None  # an info() call in flight
    failures: int = 0  # info calls failed in a row
    behind_since: float | None = None  # since when it serves (joined) an older version than the newest
    dead: str | None = None  # why its actor is gone, once its info calls keep failing (Ray stopped restarting it)

    @property
    def incarnation(self) -> tuple[int, float] | None:
        return None if self.info is None else (self.info["pid"], self.info["started_at"])


class Membership:
    """The slots and the clients that follow them (the fleet's state; see the module docstring)."""

    def __init__(self, copy_timeout: float):
        self.slots: list[Slot] = []
        self.clients: weakref.WeakSet[RolloutClient] = weakref.WeakSet()
        self.copy_timeout = copy_timeout
        self.lock = threading.RLock()  # slots, clients and joins: the monitor and the caller's thread
        self.newest_version = 0
        self.free_bundles: list[tuple[Any, int]] = []  # (placement group, bundle) with no worker, of groups in use
        self.reserved: list[tuple[Any, int]] = []  # free bundles a scale is starting workers in (their groups stay)
        self.copies: list[dict[str, Any]] = []  # every peer weight copy: from, to, version, seconds (newest last)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the monitor -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the monitor thread."""
        self._thread = threading.Thread(target=self._run, name="rollout-fleet-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the monitor thread (and wait for a join in progress)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.copy_timeout + 10)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if not ray.is_initialized():  # Ray was shut down (by the user, or at exit): any call would start a new one
                return
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the monitor outlives one bad round (Ray shutting down, say)
                logger.exception("rollout fleet monitor")

    def poll(self, wait_s: float = 0.0) -> None:
        """One round: ask every slot for its info, join new workers, let dead ones leave, spread the newest version."""
        with self.lock:
            for slot in self.slots:
                if slot.pending is None:
                    slot.pending = slot.actor.info.remote()
            pending = [slot.pending for slot in self.slots if slot.pending is not None]
            ready = set(ray.wait(pending, num_returns=len(pending), timeout=wait_s)[0]) if pending else set()
            for slot in list(self.slots):
                if slot.pending is not None and slot.pending in ready and not self._stop.is_set():
                    self._update(slot)
            self._spread_version()
            self._catch_up()

    def _update(self, slot: Slot) -> None:
        reference, slot.pending = slot.pending, None
        try:
            info = ray.get(reference)
        except _RESTARTING:  # Ray is restarting it: it comes back with a new process
            self.leave(slot)
            return
        except ray.exceptions.RayActorError as error:  # it died (while Ray restarts it, calls wait or say so)
            self.leave(slot)
            slot.failures += 1
            if slot.failures == DEAD_AFTER_FAILURES:  # Ray gave up on it: its bundle is freed for scale() to refill
                slot.dead = str(error).splitlines()[0]
                logger.error(
                    "rollout fleet: a worker's actor is gone for good (%s); the fleet goes on with %d worker(s): "
                    "scale() replaces it",
                    slot.dead,
                    len(self.slots) - 1,
                )
                self.remove([slot])
            return
        slot.failures = 0
        if slot.incarnation is not None and (info["pid"], info["started_at"]) == slot.incarnation:
            slot.info = info
            if slot.joined is None:  # it left (unavailable for a moment, or a join failed) and is back
                self.join(slot)
            else:
                self.newest_version = max(self.newest_version, info["version"])
            return
        if slot.joined is not None:  # Ray restarted it between two polls
            self.leave(slot)
        slot.info = info
        self.join(slot)

    # ---- joining and leaving -----------------------------------------------------------------------------------
    def live_clients(self) -> list[RolloutClient]:
        """The clients that follow the fleet (closed ones are dropped)."""
        for client in list(self.clients):
            if client.closed:
                self.clients.discard(client)
        return list(self.clients)

    def newest(self) -> int:
        """The newest policy version: pushed through a client, or served by a joined worker."""
        pushed = [client.min_policy_version for client in self.live_clients()]
        return max([self.newest_version, *pushed])

    def join(self, slot: Slot) -> None:
        """Bring the slot's worker to the newest version from a peer when it is behind, then add it to the clients."""
        assert slot.info is not None
        address, newest = slot.info["address"], self.newest()
        if slot.info["version"] < newest:
            slot.info["version"] = self._copy_from_peer(slot, newest)
        if slot.info["version"] < newest:
            logger.warning(
                "rollout fleet: no live worker holds version %d: %s joins with version %d and gets groups once the "
                "trainer's next push reaches it",
                newest,
                address,
                slot.info["version"],
            )
        for client in self.live_clients():
            try:
                client.add_worker(address)
            except Exception as error:  # noqa: BLE001 - one client closing meanwhile does not keep it from the rest
                logger.warning("rollout fleet: adding %s to a client failed: %s", address, error)
        slot.joined = address
        self.newest_version = max(self.newest_version, slot.info["version"])
        logger.info("rollout fleet: %s serves (version %d)", address, slot.info["version"])

    def _copy_from_peer(self, slot: Slot, newest: int) -> int:
        joined = [peer for peer in self.slots if peer is not slot and peer.joined is not None and peer.info is not None]
        for peer in joined:  # a peer's last poll may predate a push it took since (a poll it answered late)
            if peer.info["version"] < newest:
                self._confirmed_info(peer)
        peers = [peer for peer in joined if peer.info["version"] >= newest]
        for peer in sorted(peers, key=lambda s: -s.info["version"]):
            started = time.monotonic()
            try:
                copied = ray.get(
                    peer.actor.copy_weights_to.remote(slot.info["address"], self.copy_timeout),
                    timeout=self.copy_timeout + 10,
                )
            except Exception as error:  # noqa: BLE001 - try the next peer
                logger.warning("rollout fleet: copying weights from %s failed: %s", peer.joined, error)
                continue
            seconds = time.monotonic() - started
            self.copies = [
                *self.copies[-99:],
                {"from": peer.joined, "to": slot.info["address"], "version": copied, "s": seconds},
            ]
            logger.info(
                "rollout fleet: %s copied version %d to %s in %.2f s",
                peer.joined,
                copied,
                slot.info["address"],
                seconds,
            )
            return copied
        return slot.info["version"]

    def leave(self, slot: Slot) -> None:
        """Take the slot's worker out of every client (its groups are resubmitted to the others)."""
        if slot.joined is None:
            return
        for client in self.live_clients():
            try:
                client.remove_worker(slot.joined)
            except Exception as error:  # noqa: BLE001 - a closed client has nothing to remove
                logger.debug("removing %s from a client: %s", slot.joined, error)
        logger.info("rollout fleet: %s left", slot.joined)
        slot.joined = None

    def _catch_up(self) -> None:
        """Copy the newest weights from a peer to a joined worker that stayed behind them for CATCH_UP_S while no push
        was open: it leaves the clients (none of its groups is lost), takes the copy, and joins again."""
        now, newest = time.monotonic(), self.newest()
        clients = self.live_clients()
        for slot in list(self.slots):
            if slot.joined is None or slot.info is None or slot.info["version"] >= newest:
                slot.behind_since = None
                continue
            if slot.behind_since is None:
                slot.behind_since = now
            elif now - slot.behind_since >= CATCH_UP_S and not any(client.updating for client in clients):
                peers_ahead = any(peer.joined and peer.info and peer.info["version"] >= newest for peer in self.slots)
                # Its version as of now: one from a poll it answered late (frozen meanwhile) may be stale.
                if peers_ahead and self._confirmed_info(slot) and slot.info["version"] < newest:
                    logger.info(
                        "rollout fleet: %s serves version %d, behind %d: copying from a peer",
                        slot.joined,
                        slot.info["version"],
                        newest,
                    )
                    self.leave(slot)
                    self.join(slot)
                slot.behind_since = None

    def _confirmed_info(self, slot: Slot) -> bool:
        """Ask the slot's actor for its info now; True when it still runs the process its info describes, whose
        version is then brought up to date. A worker killed since the last poll must not be copied to (or from) at
        its old address (the copy would wait out its whole timeout); the next poll sees it restart and joins the new
        process instead."""
        try:
            info = ray.get(slot.actor.info.remote(), timeout=CONFIRM_S)
        except Exception:  # noqa: BLE001 - dead, restarting or slow: not now
            return False
        if slot.info is None or (info["pid"], info["started_at"]) != (slot.info["pid"], slot.info["started_at"]):
            return False
        slot.info["version"] = info["version"]
        return True

    def _spread_version(self) -> None:
        newest = self.newest()
        for client in self.live_clients():
            if client.min_policy_version < newest:
                client.min_policy_version = newest

    # ---- removing workers and reusing their bundles -------------------------------------------------------------
    def remove(self, slots: list[Slot], graceful_s: float = 0.0) -> None:
        """Take the slots' workers out of the clients, stop them (gracefully within `graceful_s`: in-flight groups
        end "abort"), kill their actors and free their bundles: a placement group none of whose bundles holds a
        worker any more is removed; the free bundles of one still in use are reused by the next `Fleet.scale`."""
        with self.lock:
            slots = [slot for slot in slots if any(slot is kept for kept in self.slots)]  # (each removed once)
            for slot in slots:
                self.leave(slot)
            self.slots = [slot for slot in self.slots if not any(slot is gone for gone in slots)]
        if not slots:
            return
        if graceful_s > 0:
            stops = [slot.actor.shutdown.remote() for slot in slots if slot.dead is None]
            if stops:
                ray.wait(stops, num_returns=len(stops), timeout=graceful_s)
        for slot in slots:
            ray.kill(slot.actor, no_restart=True)
        with self.lock:
            self.free_bundles += [(slot.group, slot.bundle) for slot in slots]
            self._remove_empty_groups()

    def take_free_bundles(self, count: int) -> list[tuple[Any, int]]:
        """Up to `count` free bundles of placement groups still in use (they are the caller's now)."""
        with self.lock:
            taken, self.free_bundles = self.free_bundles[:count], self.free_bundles[count:]
            self.reserved += taken
            return taken

    def add_started(self, slots: list[Slot], reused: list[tuple[Any, int]]) -> None:
        """Slots a scale started (in `reused` bundles and a new group): from now on the monitor watches them."""
        with self.lock:
            self.slots += slots
            self._unreserve(reused)

    def give_back(self, bundles: list[tuple[Any, int]]) -> None:
        """Bundles taken but not used (a failed scale)."""
        with self.lock:
            self._unreserve(bundles)
            self.free_bundles += bundles
            self._remove_empty_groups()

    def _unreserve(self, bundles: list[tuple[Any, int]]) -> None:
        for taken in bundles:
            self.reserved = [other for other in self.reserved if other is not taken]

    def _remove_empty_groups(self) -> None:
        used = {id(slot.group) for slot in self.slots} | {id(group) for group, _ in self.reserved}
        empty = {id(group): group for group, _ in self.free_bundles if id(group) not in used}
        self.free_bundles = [(group, bundle) for group, bundle in self.free_bundles if id(group) in used]
        for group in empty.values():
            remove_group(group)


def remove_group(group: Any) -> None:
    """Remove a placement group (its resources go back to Ray)."""
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception as error:  # noqa: BLE001 - Ray shutting down: its groups go with it
        logger.debug("removing a placement group: %s", error)
