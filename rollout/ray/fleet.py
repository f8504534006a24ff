"""`RolloutFleet`: rollout workers as Ray actors in placement groups, with clients that follow them.

    import ray
    from rollout.ray import RolloutFleet

    ray.init()                                            # or a cluster: ray.init(address="auto")
    fleet = RolloutFleet.launch(4, model="Qwen/Qwen3-0.6B", resources_per_worker={"GPU": 1})
    client = fleet.client()                               # a RolloutClient over every worker, now and later
    push_weights(client, model, version=step)             # as with workers started by hand
    fleet.scale(8); fleet.shutdown()

Each worker is one `rollout-worker` in an actor (`actor.py`), bound to its node's address and accepting only the
fleet's CurveZMQ keys (made fresh per fleet). Ray restarts an actor that dies (`max_restarts`); the fleet's monitor
(`membership.py`) brings the new process to the newest weights from a healthy peer before any client sends it a
group, and tells the clients its new address.
"""

from __future__ import annotations

import atexit
import logging
import math
import secrets
import shutil
import tempfile
import threading
import weakref
from typing import Any

import ray

from rollout.protocol.auth import load_public_key
from rollout.ray.actor import check_worker_args
from rollout.ray.keys import FleetKeys
from rollout.ray.membership import Membership, Slot
from rollout.ray.placement import start_workers
from rollout.validation import is_seconds
from trainer_bridge.client import RolloutClient

logger = logging.getLogger("rollout.ray")

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# A scale-down asks every worker for its state first, waiting this long for the answers: one killed a moment ago is
# seen gone (not serving), and removed before a healthy one.
SCALE_DOWN_POLL_S = 2.0


class RolloutFleet:
    """Rollout workers on Ray (make one with `RolloutFleet.launch`). Shut it down with `shutdown()`; it is also shut
    down when garbage collected and at interpreter exit."""

    def __init__(self, options: dict[str, Any], keys: FleetKeys, api_key: str | None):
        """Use `RolloutFleet.launch`, which starts the workers; this only holds what it made.

        Args:
            options: `launch`'s settings (the workers' arguments, resources, placement and timeouts).
            keys: the fleet's CurveZMQ keys, made fresh per fleet.
            api_key: the key HTTP clients send (launched with http=True), else None.
        """
        self._options = options
        self._keys = keys
        self.api_key = api_key
        self._key_dir = tempfile.mkdtemp(prefix="rollout-fleet-")
        self._files = keys.write(self._key_dir)
        self._membership = Membership(options["copy_timeout"])
        self._scaling = threading.Lock()  # one scale() or shutdown() at a time
        self._closed = False
        self._finalizer = weakref.finalize(self, _shut_down, self._membership, self._key_dir)

    @classmethod
    def launch(
        cls,
        num_workers: int,
        model: str = "tiny",
        resources_per_worker: dict[str, float] | None = None,
        placement_strategy: str = "PACK",
        worker_args: list[str] | tuple[str, ...] = (),
        http: bool = False,
        max_restarts: int = 4,
        placement_timeout: float = 60.0,
        ready_timeout: float = 600.0,
        copy_timeout: float = 300.0,
    ) -> RolloutFleet:
        """Start `num_workers` rollout workers, one per bundle of a Ray placement group, and return once every one
        serves. Connects to Ray with `ray.init()` when it is not yet (RAY_ADDRESS picks a cluster).

        Args:
            num_workers: how many workers.
            model: what each worker serves (`rollout-worker --model`: a preset, a hub id or a directory every node
                can read).
            resources_per_worker: one bundle's resources (default {"GPU": 1}; {"CPU": 1} for CPU workers). With a
                GPU and no --gpu/--device in `worker_args`, each worker serves on the GPU Ray gave its actor.
            placement_strategy: "PACK" (as few nodes as possible), "SPREAD", "STRICT_PACK" or "STRICT_SPREAD".
            worker_args: more `rollout-worker` arguments, e.g. ["--device", "cpu", "--num-blocks", "256"] (the fleet
                sets --bind, --model, --http, --api-key and the keys itself).
            http: also serve the OpenAI API on each worker (`http_urls`; clients send `api_key`).
            max_restarts: how many times Ray restarts a worker that died (-1: without limit).
            placement_timeout: seconds to wait for Ray to place the workers (too few resources: a clear error).
            ready_timeout: seconds to wait for every worker to load its model and serve.
            copy_timeout: seconds a peer weight copy may take.
        Raises:
            ValueError: a bad argument, naming it.
            TimeoutError: Ray could not place the workers within `placement_timeout` (names what the cluster has).
            RuntimeError: a worker failed to start (its error).
        """
        if resources_per_worker is not None and not isinstance(resources_per_worker, dict):
            raise ValueError(f"resources_per_worker: a dict of resource amounts, got {resources_per_worker!r}")
        resources = {"GPU": 1} if resources_per_worker is None else dict(resources_per_worker)
        _check_launch(num_workers, model, resources, placement_strategy, max_restarts)
        # A timeout of another type once failed deep inside Ray or the fleet (copy_timeout=None: every peer copy,
        # then shutdown(), which left the workers and their placement group running).
        for name, value in (
            ("placement_timeout", placement_timeout),
            ("ready_timeout", ready_timeout),
            ("copy_timeout", copy_timeout),
        ):
            if not is_seconds(value):
                raise ValueError(f"{name}: a positive number of seconds, got {value!r}")
        if not isinstance(http, bool):  # "no" or 0.5 would have served the API
            raise ValueError(f"http: True or False, got {http!r}")
        check_worker_args(worker_args, http)  # before list(): a string would become its characters
        worker_args = list(worker_args)
        if resources.get("GPU", 0) > 0 and not any(arg.split("=")[0] in ("--gpu", "--device") for arg in worker_args):
            worker_args += ["--gpu", "0"]  # the GPU Ray assigned: CUDA_VISIBLE_DEVICES holds only it
        if not ray.is_initialized():
            ray.init()
        options = {
            "argv": ["--model", model, *worker_args],
            "resources": resources,
            "strategy": placement_strategy,
            "http": http,
            "max_restarts": max_restarts,
            "placement_timeout": placement_timeout,
            "ready_timeout": ready_timeout,
            "copy_timeout": copy_timeout,
        }
        fleet = cls(options, FleetKeys.generate(), secrets.token_urlsafe(24) if http else None)
        # At exit, before Ray's own exit hook (registered when ray was imported: exit hooks run newest first).
        atexit.register(fleet._finalizer)
        try:
            fleet._add(num_workers)
        except BaseException:
            fleet.shutdown()
            raise
        fleet._membership.start()
        return fleet

    # ---- what users read ---------------------------------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        """Each worker's ZeroMQ address, in slot order (while Ray restarts one: its previous address)."""
        return [slot.info["address"] if slot.info else "" for slot in self._slots()]

    @property
    def workers(self) -> list[Any]:
        """The workers' Ray actor handles, in the order of `addresses`."""
        return [slot.actor for slot in self._slots()]

    @property
    def http_urls(self) -> list[str]:
        """Each worker's HTTP address (launched with http=True; clients send `api_key`): the OpenAI API's base URL
        is it with "/v1" (`openai.OpenAI(base_url=url + "/v1", api_key=fleet.api_key)`)."""
        return [slot.info["http"] if slot.info else "" for slot in self._slots()]

    def client(self, **kwargs: Any) -> RolloutClient:
        """A `RolloutClient` over every serving worker that follows the fleet: workers added, removed or restarted
        later come and go in it, each only once it serves the newest weights.

        Args:
            kwargs: `RolloutClient` arguments (timeout, heartbeat_s, dead_after_s, connect_timeout); the fleet gives
                the addresses and keys.
        """
        for name in ("addresses", "curve_secret_key", "server_public_key"):
            if name in kwargs:
                raise ValueError(f"{name}: set by the fleet")
        self._check_open()
        with self._membership.lock:
            addresses = [slot.joined for slot in self._membership.slots if slot.joined is not None]
            if not addresses:
                raise RuntimeError("no worker of the fleet serves right now (all restarting?); try again shortly")
            client = RolloutClient(
                addresses,
                curve_secret_key=self._files.trainer_secret,
                server_public_key=load_public_key(self._files.worker_secret),  # (the public half, as bytes)
                **kwargs,
            )
            client.min_policy_version = self._membership.newest()
            client.fleet = self  # a client keeps its fleet alive (the fleet closes its clients when it shuts down)
            self._membership.clients.add(client)
        return client

    def scale(self, num_workers: int) -> None:
        """Grow the fleet to `num_workers` (returns once the new workers serve, with the newest weights) or shrink
        it (workers that do not serve go first: dead or restarting ones, then those behind the newest weights; among
        equals the newest workers; their unfinished groups are resubmitted to the others, nothing is lost).

        Args:
            num_workers: the new size, at least 1.
        """
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"num_workers: a positive integer (shutdown() stops them all), got {num_workers!r}")
        self._check_open()
        with self._scaling:
            self._check_open()
            with self._membership.lock:
                current = list(self._membership.slots)
            if num_workers > len(current):
                self._add(num_workers - len(current))
            elif num_workers < len(current):
                silent = _not_answering(current, SCALE_DOWN_POLL_S)  # a worker killed a moment ago among them
                self._remove(_least_serving_first(current, silent)[: len(current) - num_workers])

    def shutdown(self) -> None:
        """Stop every worker (in-flight groups are aborted), remove the actors and placement groups, close the clients
        the fleet made. Safe to call twice."""
        self._closed = True
        with self._scaling:  # after a scale in progress
            self._finalizer()

    def __enter__(self) -> RolloutFleet:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    # ---- inside --------------------------------------------------------------------------------------------------
    def _slots(self) -> list[Slot]:
        with self._membership.lock:
            return list(self._membership.slots)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the fleet is shut down")

    def _add(self, count: int) -> None:
        """Start `count` workers (in free bundles first, then in a new placement group) and join them (see
        membership.py). Placement and start-up wait outside the membership lock: the monitor keeps serving."""
        reused = self._membership.take_free_bundles(count)
        try:
            slots = start_workers(count, reused, self._options, self._keys, self.api_key)
        except BaseException:
            self._membership.give_back(reused)
            raise
        with self._membership.lock:
            self._membership.add_started(slots, reused)
            for slot in slots:
                self._membership.join(slot)

    def _remove(self, slots: list[Slot]) -> None:
        """Take the slots' workers out of the clients and stop them (in-flight groups are resubmitted)."""
        self._membership.remove(slots, graceful_s=30)


def _not_answering(slots: list[Slot], wait_s: float) -> set[int]:
    """The `id`s of the slots whose serving process does not answer a fresh call within `wait_s` (dead, or restarted:
    a new process answers), asked here, apart from the monitor's own calls (whose answers may predate a kill)."""
    calls = {id(slot): (slot, slot.actor.info.remote()) for slot in slots}
    ready = set(ray.wait([call for _, call in calls.values()], num_returns=len(calls), timeout=wait_s)[0])
    silent = set()
    for key, (slot, call) in calls.items():
        try:
            info = ray.get(call) if call in ready else None
        except Exception:  # noqa: BLE001 - a dead or restarting actor: not serving
            info = None
        if info is None or slot.incarnation != (info["pid"], info["started_at"]):
            silent.add(key)
    return silent


def _least_serving_first(slots: list[Slot], silent: set[int] = frozenset()) -> list[Slot]:
    """The slots in the order a scale-down removes them: not serving (dead, restarting: not joined; or silent, the
    `id` of a slot whose worker did not answer just now), then behind the newest weights, then the rest; the newest
    (last started) first among equals."""
    order = {id(slot): index for index, slot in enumerate(slots)}
    return sorted(
        slots,
        key=lambda slot: (
            slot.dead is None and slot.joined is not None and id(slot) not in silent,  # False (not serving) first
            slot.behind_since is None,  # behind the newest first
            -order[id(slot)],  # newest first
        ),
    )


def _shut_down(membership: Membership, key_dir: str) -> None:
    """Everything `RolloutFleet.shutdown` does; also run by the garbage collector and at interpreter exit."""
    membership.stop()
    try:
        if ray.is_initialized():  # (else Ray is gone, and its actors and groups with it)
            membership.remove(list(membership.slots), graceful_s=30)  # (their placement groups go with them)
    finally:
        for client in list(membership.clients):
            client.close()
        shutil.rmtree(key_dir, ignore_errors=True)


def _check_launch(num_workers: Any, model: Any, resources: dict, strategy: Any, max_restarts: Any) -> None:
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
        raise ValueError(f"num_workers: a positive integer, got {num_workers!r}")
    if not isinstance(model, str) or not model:
        raise ValueError(f"model: a rollout-worker --model value (preset, hub id or directory), got {model!r}")
    for key, value in resources.items():
        if (
            not isinstance(key, str)
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value >= 0)
        ):
            raise ValueError(f"resources_per_worker: {key!r}: a resource name and a non-negative amount, got {value!r}")
    if "object_store_memory" in resources:
        raise ValueError("resources_per_worker: object_store_memory is not a worker's resource (workers use none)")
    if not any(value > 0 for value in resources.values()):
        raise ValueError(f"resources_per_worker: give each worker some resource (e.g. {{'GPU': 1}}), got {resources}")
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"placement_strategy: one of {list(PLACEMENT_STRATEGIES)}, got {strategy!r}")
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < -1:
        raise ValueError(f"max_restarts: -1 (no limit) or a non-negative integer, got {max_restarts!r}")
