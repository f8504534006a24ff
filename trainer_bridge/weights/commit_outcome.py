"""What the workers' answers to a push's weights_commit add up to: each committed worker's result, or the error that
says which workers refused and which now serve the new weights (`partial_commit`)."""

from __future__ import annotations

from typing import Any

from rollout import protocol as p
from trainer_bridge.client import RolloutError
from trainer_bridge.weights.push_links import PushLink, WorkerFailed

# What a push's result says of each worker that committed (`WeightsCommitted`'s fields).
RESULT_FIELDS = ("version", "pause_ms", "copy_ms", "drain_ms", "aborted", "recomputed")


def commit_results(
    sent: list[PushLink], live: list[PushLink], failed: dict[int, p.Error], version: int
) -> list[dict[str, Any]]:
    """Each committed worker's result (address, transport and `RESULT_FIELDS`), a worker lost after committing
    included.

    Args:
        sent: the links the commit was sent to.
        live: the push's links still live (a worker that refused and was then lost counts as lost).
        failed: each refusing worker's error, by its link's index.
        version: the version the push committed at (named in the advice of a partial commit).
    Raises:
        WorkerFailed: a worker refused and none committed: that refusal, as the push's answer.
        RolloutError: ("partial_commit") some workers refused while others committed, naming both.
    """
    failed = {index: error for index, error in failed.items() if any(link.index == index for link in live)}
    if failed:
        first = next(link for link in live if link.index in failed)
        committed = [f"{link.address} (version {link.committed.version})" for link in sent if link.committed]
        if not committed:
            raise WorkerFailed(first, failed[first.index])
        errors = "; ".join(f"{link.address}: {failed[link.index].message}" for link in live if link.index in failed)
        raise RolloutError(
            "partial_commit",
            f"the commit failed on some workers ({errors}) while {', '.join(committed)} committed: the workers "
            "now serve different weights (this client sends its groups to those that committed); push again, "
            f"with no version or one above {version} (those that committed refuse {version} itself)",
            failed[first.index].field,
        )
    return [
        {
            "address": link.address,
            "transport": link.transport,
            **{name: getattr(link.committed, name) for name in RESULT_FIELDS},
        }
        for link in sent
        if link.committed is not None
    ]
