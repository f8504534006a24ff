"""The peer weight copy: one fleet worker brings another (restarted, added, or left behind by a push) to exactly what
it serves itself: its base weights, every LoRA adapter it serves, and its policy version.

A copy is a sequence of ordinary weight transactions (the same staging, checks and commit as a trainer's push), in
version order, planned by `plan_copy` from what both workers say they serve:
- each adapter the target lacks (or holds at another version) travels alone, at its own version, so the target
  tags its tokens as the peer does ((name, version) names one push's tensors); the base travels with the first one
  unless the target already holds the peer's named base (`base_id`);
- a last transaction of the whole base brings the target to the peer's version when no adapter did (a plain
  fleet, or a whole push after the adapters);
- before all that, an adapter the target serves and the peer does not is unloaded (`adapter_unload`: one unloaded
  across the fleet while the target was down, say).
An adapter is never copied over another base than the peer's: the base goes first or with it. A copy that cannot
give the target exactly the peer's adapters is refused, naming why: an adapter the target lacks at a version no
higher than its own (versions only grow: it missed that push while taking later ones). The fleet then tries another
peer, or the worker waits for the trainer's next push.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CopyStep:
    """One transaction of a copy: `adapter` (None: the whole base) at `version`, with the base when `with_base`; with
    `unload`, adapter `adapter` stops serving instead (the version does not change)."""

    version: int
    adapter: str | None
    with_base: bool
    unload: bool = False


def plan_copy(
    peer_version: int,
    peer_base_id: str | None,
    peer_adapters: dict[str, int],
    target_version: int,
    target_base_id: str | None,
    target_adapters: dict[str, int],
) -> list[CopyStep]:
    """The transactions that bring the target to the peer's weights.

    Args:
        peer_version: the policy version the peer serves.
        peer_base_id: the peer's named base (None: unnamed).
        peer_adapters: the peer's adapters and their versions.
        target_version: the target's policy version (every transaction must exceed it, and the one before).
        target_base_id: the target's named base.
        target_adapters: the target's adapters and their versions.
    Returns:
        The steps, in order (unloads first); empty when the target serves a newer version, or the same weights.
    Raises:
        ValueError: the target lacks an adapter at a version no higher than its own (named).
    """
    missing = sorted((v, name) for name, v in peer_adapters.items() if target_adapters.get(name) != v)
    stale = [f"{name}@{v}" for v, name in missing if v <= target_version]
    if stale:
        raise ValueError(
            f"the worker at version {target_version} lacks adapters {stale}: a copy can bring an adapter only at its "
            "own version, above the worker's (push them again)"
        )
    if target_version > peer_version:
        return []  # the target is the newer one: it keeps what it serves
    # Adapters the peer serves no more (an unload changes no version: at equal versions too).
    extra = sorted(set(target_adapters) - set(peer_adapters))
    steps = [CopyStep(target_version, name, with_base=False, unload=True) for name in extra]
    if target_version == peer_version:
        return steps
    same_base = peer_base_id is not None and target_base_id == peer_base_id
    steps += [CopyStep(v, name, with_base=index == 0 and not same_base) for index, (v, name) in enumerate(missing)]
    if not missing or steps[-1].version < peer_version:
        steps.append(CopyStep(peer_version, None, with_base=True))
    return steps


def copy_weights(worker: Any, model: Any, client: Any, timeout: float) -> int:
    """Run one copy from `worker` (this process's, serving `model`) to the single worker of `client`.

    Args:
        worker: the peer's `rollout.service.zmq.worker.Worker`.
        model: the model it serves (its base weights).
        client: a `RolloutClient` connected to the target only.
        timeout: seconds each transaction's phases may take.
    Returns:
        The peer's version the copy was planned from (the target serves it when this returns).
    Raises:
        ValueError: no plan exists (`plan_copy`). RolloutError: a transaction failed.
    """
    from rollout.engine.lora.adapter_weights import to_named_tensors
    from trainer_bridge.gathering import Entry, entries_of
    from trainer_bridge.weights.adapter_unload import unload_adapter
    from trainer_bridge.weights.lora_push import AdapterPush
    from trainer_bridge.weights.weight_sync import push_weights

    table = worker.manager.engine.runner.adapters
    for _ in range(3):  # one consistent reading: no update committed between the version and the adapters
        version, base_id = worker.policy_version, worker.base_id
        adapters = {name: ref.version for name, ref in list(table.refs.items())}
        if worker.policy_version == version and all(v <= version for v in adapters.values()):
            break
    else:
        raise RuntimeError("the peer's weights kept changing while the copy was planned")
    (target,) = client.stats()
    served = {name: entry["version"] for name, entry in target.get("adapters", {}).items()}
    plan = plan_copy(version, base_id, adapters, target["policy_version"], target.get("base_id"), served)
    for step in plan:
        if step.unload:
            unload_adapter(client, step.adapter, timeout)
            continue
        if step.adapter is None:
            push_weights(client, model, version=step.version, timeout=timeout)
            continue
        tensors, scalings = to_named_tensors(table.modules_of(step.adapter))
        entries = [Entry(name, t.dtype, tuple(t.shape), lambda t=t: t) for name, t in tensors.items()]
        base = entries_of(model, None) if step.with_base else []
        adapter = AdapterPush(step.adapter, entries, scalings, base_id, base, always_base=step.with_base)
        _send_adapter(client, adapter, step.version, timeout)
    return version


def _send_adapter(client: Any, adapter: Any, version: int, timeout: float) -> None:
    """One adapter transaction (mode "keep": the target serves no group during a copy)."""
    from trainer_bridge.weights.push import WeightPush
    from trainer_bridge.weights.weight_sync import DEFAULT_BUCKET_BYTES

    push = WeightPush(
        client, [], version, "keep", DEFAULT_BUCKET_BYTES, "auto", timeout, False, None, "gloo", False, adapter
    )
    try:
        push.run()
    finally:
        push.close()
