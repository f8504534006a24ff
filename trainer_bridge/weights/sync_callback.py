"""`WeightSyncCallback`: push_weights as a transformers Trainer callback (its own module: importing it loads
transformers' trainer, which `weight_sync` itself does not need)."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from trainer_bridge.client import RolloutClient, RolloutError
from trainer_bridge.weights.weight_sync import PushResult, check_push_kwargs, push_weights

__all__ = ["WeightSyncCallback"]


class WeightSyncCallback(TrainerCallback):
    """Push the model's weights to the rollout workers after every `every` optimizer steps (HF Trainer-based loops).

    The policy version is the trainer's global step, plus an offset fixed at the first push so that it is above every
    version the workers serve: 0 against fresh workers, more for a trainer restarted or resumed from a checkpoint
    against workers that served its later steps (or another run's), whose step count starts below what they serve and
    would be refused. Versions grow from push to push (a new `train()` restarting the step count moves the offset).
    Add it on every rank (gathers are collectives); only the main process sends:
    `trainer.add_callback(WeightSyncCallback(client))`.
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
        self._offset: int | None = None  # version - global step, fixed at the first push (`_version`)
        self._last_version: int | None = None  # the version the last push asked for

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Push when the global step is a multiple of `every`."""
        if state.global_step % self.every:
            return
        client = self.client if state.is_world_process_zero else None
        version = state.global_step if client is None else self._version(client, state.global_step)
        result = push_weights(client, model, version=version, **self.push_kwargs)
        if result is not None:
            self.last_result = result

    def _version(self, client: RolloutClient, step: int) -> int:
        """The version of the push at global step `step` (main process): `step` plus the offset, which the first push
        sets from what the workers serve and this client pushed (a push at or below either is refused), and which
        grows when a step count that started again would not be above the last push.

        Args:
            client: the RolloutClient (its workers are asked their versions at the first push).
            step: the trainer's global step.
        """
        offset = self._offset
        if offset is None:
            try:
                served = [stats["policy_version"] for stats in client.stats()]
            except RolloutError:  # no worker answers: push_weights says so, once the gathers other ranks are in ended
                served = None
            offset = max(0, max(client.min_policy_version, *(served or [0])) + 1 - step)
            if served is not None:  # fixed only from the workers' own word
                self._offset = offset
        if self._last_version is not None and step + offset <= self._last_version:
            offset = self._offset = self._last_version + 1 - step
        self._last_version = step + offset
        return self._last_version


# What the callback passes push_weights itself, and what it passes.
_SET_BY_CALLBACK = {
    "client": "its own client argument",
    "model_or_named_tensors": "the trainer's model",
    "version": "the trainer's global step, offset above what the workers serve",
}
