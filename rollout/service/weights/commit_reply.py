"""What a `weights_commit` is answered with: the engine's outcome of applying an update, as a protocol reply."""

from __future__ import annotations

from rollout import protocol as p
from rollout.config import FieldError
from rollout.engine.weights.weight_table import WeightUpdateResult


def commit_reply(update_id: str, outcome: WeightUpdateResult | BaseException) -> p.Message:
    """`weights_committed` for an applied update, else the error that names why it was not.

    Args:
        update_id: the update.
        outcome: what the engine's weight-update queue reported: its result, or the exception that ended it (a
            `FieldError` naming a tensor or setting, a `TimeoutError` of mode "wait", anything else unexpected).
    """
    if isinstance(outcome, WeightUpdateResult):
        return p.WeightsCommitted(
            update_id,
            outcome.version,
            outcome.pause_ms,
            outcome.copy_ms,
            outcome.drain_ms,
            outcome.aborted,
            outcome.recomputed,
        )
    if isinstance(outcome, FieldError):
        return p.Error("bad_update", str(outcome), outcome.field, None, update_id)
    if isinstance(outcome, TimeoutError):
        return p.Error("update_timeout", str(outcome), "mode", None, update_id)
    return p.Error("internal", f"{type(outcome).__name__}: {outcome}", None, None, update_id)
