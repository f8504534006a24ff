"""A round whose every worker restarted after the step's push: they serve older weights, which a round may not use
with max_staleness=0, so the client's calls fail with "stale_workers". The step's weights are pushed again, at the
same version, and the round's unfinished groups are sent again (seeded: they sample what they would have).

- One process: `RolloutGeneration.sync_weights` pushes again.
- Several processes: each rank samples its own rows through its own client, so the ranks are not at one point and
  the rank that meets the restart pushes alone, from its own replica of the weights (DDP, DeepSpeed ZeRO-1/2: every
  rank holds them whole). Two ranks pushing at once is harmless: the second finds the version already served, or
  an update in progress on a worker; it then waits, as long as a call may (the client's timeout), until a worker
  serves the version (the other push landed, however long it takes) or its own push lands (the other failed: two
  pushes that each held some workers' update slots both fail; pauses drawn at random part them). A sharded model
  (ZeRO-3, FSDP2) is pushed by every rank together, which one rank cannot start: the round fails then, saying what
  a TRL user can do.
"""

from __future__ import annotations

import logging
import random
import socket
import time
from collections.abc import Iterable
from typing import Any

from rollout.sharded_params import is_sharded
from trainer_bridge.client import GroupResult, PromptGroup, RolloutError
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
            why_not = why_not_again(rollout, pushed_again)
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
            push_again(rollout, rollout.last_version)
            pushed_again = True


def why_not_again(rollout: Any, pushed_again: bool) -> str | None:
    """Why the step's weights cannot be pushed again (words for the error), or None when they can.

    Args:
        rollout: the trainer's `RolloutGeneration`.
        pushed_again: they were pushed again once already, for this round.
    """
    if pushed_again:
        return " (pushed again once, in vain)"
    if rollout.last_version is None:
        return ""  # nothing was pushed yet
    trainer = rollout.trainer
    if trainer.accelerator.num_processes > 1 and is_sharded(trainer.model_wrapped):
        return " (a sharded model, ZeRO-3 or FSDP2, is pushed by every rank together: one rank cannot push it again)"
    return None


def push_again(rollout: Any, version: int) -> None:
    """Push the step's weights again at `version`: every rank in one process; this rank alone among several, until
    its push lands or a worker serves `version` (another rank's push landed).

    Args:
        rollout: the trainer's `RolloutGeneration`.
        version: the version of the step's push.
    Raises:
        RolloutError: the push failed; ("update_in_progress", "update_preempted") another update held a worker's
            slot past the client's timeout, no worker serving `version` meanwhile.
    """
    trainer = rollout.trainer
    if trainer.accelerator.num_processes == 1:
        rollout.sync_weights(version)
        return
    client, model = rollout.client, trainer.accelerator.unwrap_model(trainer.model_wrapped)
    step, started, pause = trainer.state.global_step, time.monotonic(), 0.2
    while True:
        try:
            push_weights(client, model, version=version, **own_push_kwargs(rollout.push_kwargs))
            return
        except RolloutError as error:
            busy = error.code in ("update_in_progress", "update_preempted")  # another update holds a worker's slot
            if not busy and error.field != "version":
                raise
            if not busy:  # a worker serves the version already: another rank's push
                logger.info("another rank pushed step %d's weights again (%s)", step, error)
                learn_pushed_version(client, version)
                return
            waited = time.monotonic() - started
            if waited >= getattr(client, "timeout", 0.0):
                raise RolloutError(
                    error.code,
                    f"pushing step {step}'s weights again: another weight update held a worker's update slot for "
                    f"{waited:.0f} s (the client's timeout), no worker serving version {version} meanwhile: {error}",
                    error.field,
                ) from None
        # Another update holds a worker's slot: another rank's push, which lands, or fails as this one did (two pushes
        # that each held some workers' slots); a pause drawn at random parts two ranks that would meet again.
        time.sleep(random.uniform(pause / 2, pause))  # (the client's heartbeat brings the workers' versions)
        pause = min(2 * pause, 5.0)
        if client.outage() is None:  # a live worker serves the version: the other push landed
            logger.info("another rank pushed step %d's weights again", step)
            return


def learn_pushed_version(client: Any, version: int) -> None:
    """A rank learns the version another rank pushed (the main process's sync, another rank's push again): its
    client's floor rises to it, so that its rounds never go to a worker that restarted since, with older weights
    ("stale_workers" instead); the client asks its workers their versions at once (`RolloutClient.min_policy_version`).

    Args:
        client: this rank's RolloutClient (anything without `min_policy_version` is left alone).
        version: the version the other rank's push made current.
    """
    if hasattr(client, "min_policy_version"):
        client.min_policy_version = max(client.min_policy_version, version)


def own_push_kwargs(push_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The push settings for a rank's own push: never `preempt` (it would take the slot from another rank's push of
    the same weights, which then fails); `dist_host` (transport "torch.distributed") names the main process's host,
    where a worker connects back to: on another host this rank could not listen there (and the worker would refuse
    it), so the push then picks this host's address towards the workers.

    Args:
        push_kwargs: the trainer's `rollout_push_kwargs`.
    """
    host = push_kwargs.get("dist_host")
    dropped = {"preempt"} | (set() if host is None or _is_this_machine(host) else {"dist_host"})
    return {name: value for name, value in push_kwargs.items() if name not in dropped}


def _is_this_machine(host: str) -> bool:
    """Whether `host` (an IP address) is one of this machine's: only those can be bound."""
    try:
        probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError:
        return False
    try:
        probe.bind((host, 0))
        return True
    except OSError:
        return False
    finally:
        probe.close()
