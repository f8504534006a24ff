"""A round whose every worker restarted after the step's push: they serve older weights, which a round may not use
with max_staleness=0, so the client's calls fail with "stale_workers". The step's weights are pushed again, at the
same version, and the round's unfinished groups are sent again (seeded: they sample what they would have).

- One process: `RolloutGeneration.sync_weights` pushes again.
- Several processes: each rank samples its own rows through its own client, so the ranks are not at one point and
  the rank that meets the restart pushes alone, from its own replica of the weights (DDP, DeepSpeed ZeRO-1/2: every
  rank holds them whole). Two ranks pushing at once is harmless: the second finds an update in progress, or the
  version already served, and its groups wait for the first's push as for any current worker. A sharded model
  (ZeRO-3, FSDP2) is pushed by every rank together, which one rank cannot start: the round fails then, saying what
  a TRL user can do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from trainer_bridge.client import GroupResult, PromptGroup, RolloutError
from trainer_bridge.gathering import is_sharded
from trainer_bridge.weights.weight_sync import push_weights

logger = logging.getLogger("trainer_bridge.trl")


def generate_groups(rollout: Any, groups: list[PromptGroup]) -> Iterable[GroupResult]:
    """The groups' results as they finish, pushing the step's weights again (once) if every worker restarted since.

    Args:
        rollout: the trainer's `RolloutGeneration` (its client, trainer, push settings and last pushed version).
        groups: the round's groups, seeded.
    Raises:
        RolloutError: ("stale_workers") the weights cannot be pushed again, or were in vain, saying why and what to
            do; any other failure of the round as the client raised it.
    """
    finished: set[str] = set()
    pushed_again = False
    while True:
        try:
            for result in rollout.client.generate_many([g for g in groups if g.group_id not in finished]):
                finished.add(result.group_id)
                yield result
            return
        except RolloutError as error:
            if error.code != "stale_workers":
                raise
            step, reason = rollout.trainer.state.global_step, str(error).removeprefix("stale_workers: ")
            why_not = _why_not_again(rollout, pushed_again)
            if why_not is not None:  # the client's advice (push again) is not the TRL user's to follow mid-train()
                raise RolloutError(
                    "stale_workers",
                    f"{reason} In RolloutGRPOTrainer: a worker restarted after step {step}'s push serves older "
                    f"weights{why_not}, which this round may not use (max_staleness=0); resume from the last "
                    "checkpoint, or train with max_staleness >= 1, whose next push brings a restarted worker back",
                ) from None
            logger.warning(
                "every rollout worker serves weights older than step %d's (%s): a worker restarted after the push; "
                "pushing them again at version %d",
                step,
                reason,
                rollout.last_version,
            )
            _push_again(rollout, rollout.last_version)
            pushed_again = True


def _why_not_again(rollout: Any, pushed_again: bool) -> str | None:
    """Why the step's weights cannot be pushed again (words for the error), or None when they can."""
    if pushed_again:
        return " (pushed again once, in vain)"
    if rollout.last_version is None:
        return ""  # nothing was pushed yet
    trainer = rollout.trainer
    if trainer.accelerator.num_processes > 1 and is_sharded(trainer.model_wrapped):
        return " (a sharded model, ZeRO-3 or FSDP2, is pushed by every rank together: one rank cannot push it again)"
    return None


def _push_again(rollout: Any, version: int) -> None:
    """Push the step's weights again at `version`: every rank in one process; this rank alone among several."""
    trainer = rollout.trainer
    if trainer.accelerator.num_processes == 1:
        rollout.sync_weights(version)
        return
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    try:
        push_weights(rollout.client, model, version=version, **rollout.push_kwargs)
    except RolloutError as error:
        if error.code != "update_in_progress" and error.field != "version":
            raise
        # Another rank is pushing the same weights, or pushed them: the groups wait for that push instead.
        logger.info("another rank pushes step %d's weights again (%s)", trainer.state.global_step, error)
