"""`WeightSyncCallback`: push_weights as a transformers Trainer callback (its own module: importing it loads
transformers' trainer, which `weight_sync` itself does not need)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from trainer_bridge.client import RolloutClient
from trainer_bridge.weights.weight_sync import PushResult, check_push_kwargs, push_weights

__all__ = ["WeightSyncCallback"]


class WeightSyncCallback(TrainerCallback):
    """Push the model's weights to the rollout workers after every `every` optimizer steps (HF Trainer-based loops).

    The policy version is the trainer's global step. Add it on every rank (gathers are collectives); only the main
    process sends: `trainer.add_callback(WeightSyncCallback(client))`.
    """

    def __init__(self, client: RolloutClient | None, every: int = 1, **push_kwargs: Any):
        """
        Args:
            client: the RolloutClient (may be None on ranks other than the main one).
            every: push after every `every` optimizer steps.
            **push_kwargs: passed to `push_weights` (mode, transport, bucket_bytes, timeout, ...); not `version`.
        Raises:
            TypeError: naming a keyword `push_weights` does not take, or one the callback sets (`version`).
            ValueError: naming a bad setting (`every`, or a push setting: checked now, not at the first step).
        """
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        check_push_kwargs(push_kwargs, _SET_BY_CALLBACK, "WeightSyncCallback")
        self.client = client
        self.every = every
        self.push_kwargs = push_kwargs
        self.last_result: PushResult | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Push when the global step is a multiple of `every`."""
        if state.global_step % self.every:
            return
        client = self.client if state.is_world_process_zero else None
        result = push_weights(client, model, version=state.global_step, **self.push_kwargs)
        if result is not None:
            self.last_result = result


# What the callback passes push_weights itself, and what it passes.
_SET_BY_CALLBACK = {
    "client": "its own client argument",
    "model_or_named_tensors": "the trainer's model",
    "version": "the trainer's global step",
}
