"""The trainer side of rollout: `RolloutClient` to get completions from rollout workers, and `push_weights` /
`WeightSyncCallback` to send them new weights (`unload_adapter` to stop serving a pushed LoRA adapter); `AsyncRollouts` to generate the next steps' groups while training,
within a staleness bound; `ColocatedEngine` to generate inside the trainer's process on its own model instead;
`routing_replay` and `routes_for` to route an MoE policy's training forward as the rollout did; `batch_invariant` to
run the trainer's forward so that a padded batch gives each row the bits it gets alone. `import trainer_bridge` loads
no torch: the weight-sync, colocated, routing-replay and batch-invariant names import it on first use."""

from typing import Any

from trainer_bridge.async_rollouts import AsyncRollouts, RolloutBatch
from trainer_bridge.client import Completion, Delta, GroupResult, PromptGroup, RolloutClient, RolloutError, WorkerBusy
from trainer_bridge.weights.adapter_unload import unload_adapter

_WEIGHT_SYNC = ("PushResult", "WeightSyncCallback", "iter_weights", "push_weights", "weight_specs")
_ROUTE_REPLAY = ("routes_for", "routing_replay")

__all__ = ["Completion", "Delta", "GroupResult", "PromptGroup", "RolloutClient", "RolloutError", "WorkerBusy"]
__all__ += ["AsyncRollouts", "RolloutBatch", "unload_adapter"]
__all__ += [*_WEIGHT_SYNC, "ColocatedEngine", *_ROUTE_REPLAY, "batch_invariant"]


def __getattr__(name: str) -> Any:
    if name == "WeightSyncCallback":  # loads transformers' Trainer
        from trainer_bridge.weights import sync_callback

        return sync_callback.WeightSyncCallback
    if name == "ColocatedEngine":  # loads torch and the engine
        from trainer_bridge import colocated

        return colocated.ColocatedEngine
    if name in _WEIGHT_SYNC:
        from trainer_bridge.weights import weight_sync

        return getattr(weight_sync, name)
    if name == "batch_invariant":  # loads torch and transformers
        from rollout.invariant import mode

        return mode.batch_invariant
    if name in _ROUTE_REPLAY:  # loads torch and the engine's router taps
        from trainer_bridge import route_replay

        return getattr(route_replay, name)
    raise AttributeError(f"module 'trainer_bridge' has no attribute {name!r}")
