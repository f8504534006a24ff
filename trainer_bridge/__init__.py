"""The trainer side of rollout: `RolloutClient` to get completions from rollout workers, and `push_weights` /
`WeightSyncCallback` to send them new weights; `AsyncRollouts` to generate the next steps' groups while training,
within a staleness bound; `ColocatedEngine` to generate inside the trainer's process on its own model instead. `import trainer_bridge` loads no torch: the weight-sync and colocated names import it on first use."""

from typing import Any

from trainer_bridge.async_rollouts import AsyncRollouts, RolloutBatch
from trainer_bridge.client import Completion, Delta, GroupResult, PromptGroup, RolloutClient, RolloutError, WorkerBusy

_WEIGHT_SYNC = ("PushResult", "WeightSyncCallback", "iter_weights", "push_weights", "weight_specs")

__all__ = ["Completion", "Delta", "GroupResult", "PromptGroup", "RolloutClient", "RolloutError", "WorkerBusy"]
__all__ += ["AsyncRollouts", "RolloutBatch"]
__all__ += [*_WEIGHT_SYNC, "ColocatedEngine"]


def __getattr__(name: str) -> Any:
    if name == "WeightSyncCallback":  # loads transformers' Trainer
        from trainer_bridge import sync_callback

        return sync_callback.WeightSyncCallback
    if name == "ColocatedEngine":  # loads torch and the engine
        from trainer_bridge import colocated

        return colocated.ColocatedEngine
    if name in _WEIGHT_SYNC:
        from trainer_bridge import weight_sync

        return getattr(weight_sync, name)
    raise AttributeError(f"module 'trainer_bridge' has no attribute {name!r}")
