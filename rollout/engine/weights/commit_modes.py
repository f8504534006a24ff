"""What a weight update's commit mode does to the requests in flight (`Engine.update_weights`): "recompute" drops
their KV and re-prefills them under the new weights, "abort" ends those that sampled under the old ones. ("keep"
touches nothing.) Torch-free, like the scheduler whose queues it rearranges."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from rollout.engine.requests.request import Request
from rollout.engine.scheduling.scheduler import Scheduler


def _arrival(request: Request) -> int:
    return request.arrival


def _split(scheduler: Scheduler, affects: Callable[[Request], bool] | None) -> list[Request]:
    """Take the running and swapped requests `affects` selects out of their queues (oldest first)."""
    in_flight = scheduler.running + list(scheduler.swapped)
    if affects is None:
        scheduler.running, scheduler.swapped = [], deque()
        return sorted(in_flight, key=_arrival)
    scheduler.running = [request for request in scheduler.running if not affects(request)]
    scheduler.swapped = deque(request for request in scheduler.swapped if not affects(request))
    return sorted((request for request in in_flight if affects(request)), key=_arrival)


def recompute_in_flight(scheduler: Scheduler, affects: Callable[[Request], bool] | None = None) -> int:
    """Drop the KV of every running and swapped request and queue it to be re-prefilled (prompt + tokens so far),
    oldest first, ahead of new requests.

    Args:
        scheduler: the engine's scheduler.
        affects: which requests the update concerns (None: all; an adapter update: that adapter's).
    Returns:
        How many requests were reset.
    """
    reset = _split(scheduler, affects)
    for request in reversed(reset):
        scheduler.reset_for_recompute(request)
    return len(reset)


def abort_in_flight(
    scheduler: Scheduler, affects: Callable[[Request], bool] | None = None
) -> tuple[list[Request], int]:
    """End every request that sampled tokens with finish_reason "abort" (its partial output goes back). Running or
    swapped ones that sampled nothing yet (a prompt mid-prefill) are queued for recompute instead: nothing of theirs
    came from the old weights.

    Args:
        scheduler: the engine's scheduler.
        affects: which requests the update concerns (None: all; an adapter update: that adapter's).
    Returns:
        (the ended requests, how many were queued for recompute).
    """
    ended: list[Request] = []
    for request in [r for r in scheduler.waiting if r.num_output_tokens > 0 and (affects is None or affects(r))]:
        scheduler.waiting.remove(request)
        ended += scheduler.finish(request, "abort")
    fresh = []
    for request in _split(scheduler, affects):
        if request.num_output_tokens > 0:
            ended += scheduler.finish(request, "abort")
        else:
            fresh.append(request)
    for request in reversed(fresh):
        scheduler.reset_for_recompute(request)
    return ended, len(fresh)
