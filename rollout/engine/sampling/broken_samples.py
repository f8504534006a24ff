"""Samples whose model logits turned non-finite (NaN or Inf: an adapter or the model overflowed): each ends with
finish_reason "error" naming its adapter (or the base model), never with a meaningless token, and its KV blocks are
quarantined (out of the prefix cache at once, zeroed before reuse: `BlockManager.quarantine`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from rollout.engine.requests.request import Request
from rollout.engine.scheduling.block_manager import BlockManager
from rollout.engine.scheduling.scheduler import Scheduler

logger = logging.getLogger(__name__)


def broken_reason(request: Request) -> str:
    """The error a sample with non-finite logits ends with, naming what produced them."""
    adapter = request.adapter
    source = "the base model" if adapter is None else f"adapter {adapter.name!r} (version {adapter.version})"
    return f"the logits of {source} turned non-finite (NaN or Inf) at this position: the sample was ended"


def end_broken(
    scheduler: Scheduler, block_manager: BlockManager, samples: Sequence[tuple[Request, int]], rows: Sequence[int]
) -> list[Request]:
    """End the samples of these rows with an error, their blocks quarantined first.

    Args:
        scheduler: the engine's scheduler (it frees the samples' blocks).
        block_manager: the engine's block manager.
        samples: the step's (request, logits row) pairs.
        rows: the indices into `samples` whose logits were not finite.
    Returns:
        The requests that ended (with unforked samples of their groups).
    """
    failed: list[Request] = []
    for index in rows:
        request = samples[index][0]
        if request.is_finished:
            continue
        request.drop_placeholder()
        reason = broken_reason(request)
        logger.warning("request %s: %s", request.request_id, reason)
        block_manager.quarantine(request)
        failed += scheduler.fail(request, reason)
    return failed
