"""Placing and starting a fleet's workers: a placement group for the bundles not reused from an earlier one, one
actor per bundle, each waited for until it serves. On any failure (Ray cannot place them within the timeout, a worker
fails to start, Ctrl-C) what was made is taken down again: no actor and no placement group is left behind."""

from __future__ import annotations

import re
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rollout.ray.actor import RolloutWorkerActor
from rollout.ray.keys import FleetKeys
from rollout.ray.membership import Slot, remove_group

# Ray's resource names of a placement group's bundles: "<resource>_group_<id>", "<resource>_group_<index>_<id>".
_GROUP_RESOURCE = re.compile(r"_group_(\d+_)?[0-9a-f]{16,}$")


def start_workers(
    count: int, reused: list[tuple[Any, int]], options: dict[str, Any], keys: FleetKeys, api_key: str | None
) -> list[Slot]:
    """Start `count` workers: in the `reused` bundles first, then in a new placement group; return their slots,
    each with its first `info` (every worker serves, not yet joined to any client).

    Raises:
        TimeoutError: Ray could not place the new bundles within `placement_timeout`, or a worker did not serve within
            `ready_timeout`.
        RuntimeError: a worker failed to start (its own error).
        ValueError: resources Ray refuses for an actor.
    """
    resources = options["resources"]
    places = list(reused)
    group = None
    slots: list[Slot] = []
    try:
        if count > len(places):
            group = _place(count - len(places), options)
            places += [(group, bundle) for bundle in range(count - len(places))]
        remote = ray.remote(RolloutWorkerActor)
        actor_options = {
            "num_cpus": resources.get("CPU", 0),
            "num_gpus": resources.get("GPU", 0),
            "resources": {key: value for key, value in resources.items() if key not in ("CPU", "GPU", "memory")},
            "max_restarts": options["max_restarts"],
            "max_concurrency": 4,  # info() answers while a peer weight copy runs
            # Ray's workers renice themselves to RAY_worker_niceness (15 by default) as they start, where any busy
            # process beside them takes nearly all of a core: a serving loop must not wait on its neighbours.
            "runtime_env": {"env_vars": {"RAY_worker_niceness": "0"}},
        }
        if "memory" in resources:  # Ray takes an actor's memory as its own option, not as a resource
            actor_options["memory"] = resources["memory"]
        try:
            remote.options(**actor_options)
        except ValueError as error:  # e.g. "memory", which Ray takes only as its own option
            raise ValueError(f"resources_per_worker: {error}") from None
        for place_group, bundle in places:
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=place_group, placement_group_bundle_index=bundle
            )
            actor = remote.options(scheduling_strategy=strategy, **actor_options).remote(
                options["argv"], keys, options["http"], api_key
            )
            slots.append(Slot(actor, place_group, bundle))
        deadline = time.monotonic() + options["ready_timeout"]
        for index, slot in enumerate(slots):
            try:
                slot.info = ray.get(slot.actor.info.remote(), timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(
                    f"a worker did not serve within ready_timeout={options['ready_timeout']:g} s"
                ) from None
            except ray.exceptions.RayActorError as error:
                raise RuntimeError(f"worker {index + 1} of {count} failed to start: {_reason(error)}") from None
        return slots
    except BaseException:
        for slot in slots:
            ray.kill(slot.actor, no_restart=True)
        if group is not None:
            remove_group(group)
        raise


def _place(count: int, options: dict[str, Any]) -> Any:
    """A new placement group of `count` bundles, once Ray placed it (else TimeoutError naming what the cluster has)."""
    group = placement_group([dict(options["resources"]) for _ in range(count)], strategy=options["strategy"])
    try:
        ray.get(group.ready(), timeout=options["placement_timeout"])
    except ray.exceptions.GetTimeoutError:
        remove_group(group)
        raise TimeoutError(
            f"Ray could not place {count} worker(s) of {options['resources']} ({options['strategy']}) within "
            f"{options['placement_timeout']:g} s: the cluster has {_plain(ray.cluster_resources())}, of which "
            f"{_plain(ray.available_resources())} are free. Lower num_workers or resources_per_worker, or add nodes."
        ) from None
    except BaseException:
        remove_group(group)
        raise
    return group


def _plain(resources: dict[str, float]) -> dict[str, float]:
    """A resource table as a user asks for resources: without the names Ray makes for each placement group's bundles
    (CPU_group_0_<id>, bundle_group_<id>: two per bundle, which buried the CPUs and GPUs in the message) and for
    each node (node:<ip>)."""
    return {
        name: value
        for name, value in sorted(resources.items())
        if not _GROUP_RESOURCE.search(name) and not name.startswith("node:")
    }


def _reason(error: BaseException) -> str:
    text = str(error)
    for line in reversed(text.splitlines()):  # the actor's own exception is the traceback's last line
        if line.strip() and not line.startswith(" "):
            return line.strip()
    return text
