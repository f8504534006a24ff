"""`WeightSyncCallback`: push_weights as a transformers Trainer callback (its own module: importing it loads
transformers' trainer, which `weight_sync` itself does not need)."""

from __future__ import annotations

import inspect
from typing import Any

from transformers import TrainerCallback

from trainer_bridge.client import RolloutClient
from trainer_bridge.weights.weight_sync import PushResult, check_push_settings, push_weights

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
        _check_push_kwargs(push_kwargs)
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


def _check_push_kwargs(push_kwargs: dict[str, Any]) -> None:
    """Refuse, by name, what the first push would fail on, after a whole training step.

    Args:
        push_kwargs: the callback's keywords for `push_weights`.
    Raises:
        TypeError: a keyword the callback sets, or one `push_weights` does not take.
        ValueError: a bad mode, transport, bucket_bytes, timeout or adapters (`check_push_settings`).
    """
    taken = [name for name in inspect.signature(push_weights).parameters if name not in _SET_BY_CALLBACK]
    for name in push_kwargs:
        if name in _SET_BY_CALLBACK:
            raise TypeError(f"{name}: WeightSyncCallback sets it ({_SET_BY_CALLBACK[name]}); leave it out")
        if name not in taken:
            raise TypeError(f"{name}: not a push_weights setting; WeightSyncCallback takes {', '.join(taken)}")
    check_push_settings(**push_kwargs)
