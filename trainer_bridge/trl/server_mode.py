"""The "server" mode of `RolloutGRPOTrainer`: the trainer's client to the rollout workers, what they serve read
once at construction (their policy version, whether they run batch-invariant, where and in which dtype they compute
log-probs), and the generation backend for the trainer's settings: `RolloutGeneration` (synchronous),
`AsyncRolloutGeneration` (max_staleness) or `PartialRolloutGeneration` (partial_rollouts)."""

from __future__ import annotations

import logging
from typing import Any

from accelerate.utils import broadcast_object_list

from trainer_bridge.client import RolloutClient, RolloutError
from trainer_bridge.trl.generation import RolloutGeneration

logger = logging.getLogger("trainer_bridge.trl")
LOW = ("bfloat16", "float16")  # dtypes whose head --fp32-logits computes in fp32


def server_generation(
    trainer: Any, workers: Any, push_kwargs: dict[str, Any] | None, client_kwargs: dict[str, Any] | None
) -> RolloutGeneration:
    """The backend of "server" mode: this rank's client (set as `trainer.rollout_client` at once, so that a trainer
    refused later closes the client it made), and the policy version the workers start from.

    Args:
        trainer: the RolloutGRPOTrainer being built (its accelerator, args, settings).
        workers: `rollout_workers`: address(es), a RolloutClient, or a `rollout.ray.RolloutFleet`.
        push_kwargs: `rollout_push_kwargs`.
        client_kwargs: `rollout_client_kwargs`.
    Raises:
        RolloutError: ("unreachable") the workers' versions could not be read. ValueError: batch_invariant=True and a
            worker that does not run it, or computes its head otherwise than the trainer.
    """
    trainer._owns_rollout_client = not isinstance(workers, RolloutClient)
    if isinstance(workers, RolloutClient):
        client = workers
    elif callable(getattr(workers, "client", None)):  # a rollout.ray.RolloutFleet: a client that follows it
        client = workers.client(**(client_kwargs or {}))
    else:
        client = RolloutClient(workers, **(client_kwargs or {}))
    trainer.rollout_client = client
    # The workers may have served other weights before: version base + step is this run's weights at `step`.
    # (A collective here, at construction, never inside generate.)
    # [version or error, a refusal of batch_invariant, the workers' devices, their dtypes, their smallest context]
    current: list[Any] = [0, None, [], [], None]
    if trainer.accelerator.is_main_process:
        try:
            stats = client.stats()
            devices = sorted({str(s.get("device", "unknown")) for s in stats})
            dtypes = sorted({str(s.get("dtype", "unknown")) for s in stats})
            contexts = [s["max_model_len"] for s in stats if isinstance(s.get("max_model_len"), int)]
            context = min(contexts, default=None)
            current = [max((s["policy_version"] for s in stats), default=0), None, devices, dtypes, context]
            plain = sum(1 for s in stats if not s.get("batch_invariant", False))
            fp32_head = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
            # (--fp32-logits changes only a bf16/fp16 worker's head: an fp32 worker's is fp32 either way)
            other_head = sum(1 for s in stats if s.get("dtype") in LOW and bool(s.get("fp32_logits")) != fp32_head)
            if trainer.batch_invariant and plain:
                current[1] = (
                    f"batch_invariant=True: {plain} of {len(stats)} workers do not run batch-invariant; start them "
                    "with rollout-worker --batch-invariant"
                )
            elif trainer.batch_invariant and other_head:
                current[1] = (
                    f"batch_invariant=True: {other_head} of {len(stats)} workers compute their head "
                    f"{'without' if fp32_head else 'with'} --fp32-logits, the trainer's GRPOConfig."
                    f"cast_lm_head_to_fp32 is {fp32_head}"
                )
            low = sorted({str(s.get("dtype")) for s in stats if s.get("dtype") in LOW and not s.get("fp32_logits")})
            if fp32_head and low:  # TRL scores with its head in fp32; these workers sample with theirs in bf16/fp16
                logger.warning(
                    "GRPOConfig.cast_lm_head_to_fp32 scores the completions with the head in float32, and rollout "
                    "workers compute theirs in %s: their log-probs differ by rounding, which TRL's importance-sampling "
                    "correction takes for off-policy samples; start them with rollout-worker --fp32-logits",
                    ", ".join(low),
                )
        except Exception as error:  # noqa: BLE001 - handed to every rank
            current = [f"cannot read the workers' policy version: {error}", None, [], [], None]
    if trainer.accelerator.num_processes > 1:
        broadcast_object_list(current, from_process=0)
    if isinstance(current[0], str):
        raise RolloutError("unreachable", current[0])
    if current[1] is not None:
        raise ValueError(current[1])
    trainer._worker_placement = current[2:4]  # where and in which dtype the workers compute log-probs (old_logps.py)
    generation = _generation(trainer, client, current[0] + 1, push_kwargs)
    if current[4] is not None:
        generation.context = (current[4], "the workers' context")
    return generation


def _generation(trainer: Any, client: RolloutClient, base_version: int, push_kwargs: dict[str, Any] | None) -> Any:
    """The server-mode backend the trainer's settings call for: in order, sent ahead (max_staleness), or partial."""
    if not (trainer.partial_rollouts or trainer.max_staleness):
        return RolloutGeneration(trainer, client, base_version, **(push_kwargs or {}))
    ahead = dict(max_staleness=trainer.max_staleness, stale_policy=trainer.stale_policy, **(push_kwargs or {}))
    if trainer.partial_rollouts:
        from trainer_bridge.trl.partial import PartialRolloutGeneration

        rounds, overprovision = trainer._partial_settings
        return PartialRolloutGeneration(
            trainer, client, base_version, max_partial_rounds=rounds, partial_overprovision=overprovision, **ahead
        )
    from trainer_bridge.trl.async_mode import AsyncRolloutGeneration

    return AsyncRolloutGeneration(trainer, client, base_version, **ahead)
