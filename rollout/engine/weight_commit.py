"""Committing new weights between two engine steps, the same way for a whole-model update (`Engine.update_weights`)
and for one LoRA adapter (`Engine.load_adapter`): finish the step in flight, copy, bump the policy version, forget
cached prefixes, then apply the commit mode to the requests the new weights serve."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rollout.config import FieldError
from rollout.engine.commit_modes import abort_in_flight, recompute_in_flight
from rollout.engine.request import Request
from rollout.engine.weight_table import WeightUpdateResult

if TYPE_CHECKING:
    from rollout.engine.engine import Engine


def commit(
    engine: Engine,
    copy: Callable[[], None],
    new_version: int,
    mode: str,
    started: float,
    affects: Callable[[Request], bool] | None = None,
) -> WeightUpdateResult:
    """Apply checked weights. Nothing here refuses an update except mode "wait" with samples in flight (before
    anything changed).

    Args:
        engine: the engine.
        copy: copies the checked tensors into place.
        new_version: the policy version they set.
        mode: "keep", "recompute", "abort" or "wait" (see `Engine.update_weights`).
        started: `time.perf_counter()` when the update's checks began (its pause counts from there).
        affects: which in-flight requests "recompute" and "abort" act on (None: all of them).
    Returns:
        The `WeightUpdateResult`, with the drained step's outputs and the aborted samples' final ones.
    Raises:
        FieldError: ("mode") "wait" while samples are in flight.
    """
    engine._drain()  # the step in flight ran on the old weights: its tokens are tagged with the old version
    if mode == "wait" and engine.num_in_flight():
        raise FieldError("mode", f"'wait' needs a drained engine; {engine.num_in_flight()} samples are in flight")
    copy_started = time.perf_counter()
    copy()
    engine.runner.weights_changed()
    copy_ms = (time.perf_counter() - copy_started) * 1000
    engine.block_manager.policy_version = new_version
    # Cached prefixes of old versions can never match again (the version is in their hash): let them go.
    engine.block_manager.reset_prefix_cache()
    result = WeightUpdateResult(new_version, mode, 0.0, copy_ms)
    result.outputs, engine._undelivered = engine._undelivered, []
    if mode == "recompute":
        result.recomputed = recompute_in_flight(engine.scheduler, affects)
    elif mode == "abort":
        ended, result.recomputed = abort_in_flight(engine.scheduler, affects)
        aborted = engine._outputs(ended)
        result.outputs += aborted
        result.aborted = sum(1 for output in aborted if output.finish_reason == "abort")
    engine.num_weight_updates += 1
    result.pause_ms = (time.perf_counter() - started) * 1000
    return result
