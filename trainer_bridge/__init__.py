"""The trainer side of rollout: `RolloutClient` to get completions from rollout workers, and `push_weights` /
`WeightSyncCallback` to send them new weights. `import trainer_bridge` loads no torch: the weight-sync names import
it on first use."""

from typing import Any

from trainer_bridge.client import Completion, Delta, GroupResult, PromptGroup, RolloutClient, RolloutError, WorkerBusy

_WEIGHT_SYNC = ("PushResult", "WeightSyncCallback", "iter_weights", "push_weights", "weight_specs")

__all__ = ["Completion", "Delta", "GroupResult", "PromptGroup", "RolloutClient", "RolloutError", "WorkerBusy"]
__all__ += list(_WEIGHT_SYNC)


def __getattr__(name: str) -> Any:
    if name == "WeightSyncCallback":  # loads transformers' Trainer
        from trainer_bridge import sync_callback

        return sync_callback.WeightSyncCallback
    if name in _WEIGHT_SYNC:
        from trainer_bridge import weight_sync

        return getattr(weight_sync, name)
    raise AttributeError(f"module 'trainer_bridge' has no attribute {name!r}")
