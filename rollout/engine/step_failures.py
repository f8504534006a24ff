"""What a failed step does to its samples (the step loop's `failures`): a step whose launch raised, a step whose
tokens could not be brought to the host, a drafted step whose logits turned non-finite.

- `ended_with_error`: every sample of the named groups ends with finish_reason "error", naming the exception;
- `after_failed_launch`: a launch that raised with one group in it ends that group; with several, which one failed is
  not known, so every sample of the step still running goes back to be recomputed as a suspect, each group's tried in
  steps of their own (`scheduling/suspects.py`), and only a group that fails alone ends;
- `recompute_without_drafts`: a drafted sample whose step turned non-finite is recomputed from its resolved tokens,
  its KV quarantined and drafting off for it.
"""

from __future__ import annotations

import logging

from rollout.engine.requests.request import Request, RequestStatus
from rollout.engine.sampling.sampler import Sampler
from rollout.engine.scheduling.batch import ScheduledBatch
from rollout.engine.scheduling.scheduler import Scheduler

logger = logging.getLogger("rollout.engine.engine")


class StepFailures:
    """The step loop's answers to a failed step (module docstring)."""

    def __init__(self, scheduler: Scheduler, sampler: Sampler):
        """
        Args:
            scheduler: the engine's scheduler (its queues, its block manager, its suspects and drafter).
            sampler: the engine's sampler (a recomputed sample gives back its sampling slot).
        """
        self.scheduler = scheduler
        self.sampler = sampler

    def ended_with_error(self, group_ids: set[str], error: BaseException) -> list[Request]:
        """End every sample of these groups with finish_reason "error"; the samples.

        Args:
            group_ids: the groups to end.
            error: what failed (its type and message become each sample's error).
        """
        ended = self.scheduler.abort(*group_ids)
        for request in ended:
            request.finish_reason, request.error = "error", f"{type(error).__name__}: {error}"
        return ended

    def after_failed_launch(self, batch: ScheduledBatch, error: BaseException) -> list[Request]:
        """A step's launch raised: its one group ends with the error, or, with several, none ends now and each
        sample still running goes back to be recomputed as a suspect. Returns the samples ended.

        Their KV is freed, not quarantined: the step advanced nothing, so whatever it wrote lies past each sample's
        computed tokens, in blocks no prefix hash names (a full hashed block is never written again), as when a
        failed step ended its groups. Quarantine would also taint the group's prompt blocks that its other samples
        still hold.

        Args:
            batch: the step whose launch raised.
            error: what it raised.
        """
        groups = {seq.request.group_id for seq in batch.sequences} | {r.group_id for r, _ in batch.samples}
        if len(groups) == 1:
            return self.ended_with_error(groups, error)  # its suspects, ended, are forgotten
        logger.warning(
            "retrying the %d groups of the failed step one at a time, to end only the one that failed", len(groups)
        )
        requests = {id(seq.request): seq.request for seq in batch.sequences}
        requests.update((id(request), request) for request, _ in batch.samples)
        running = [request for request in requests.values() if request.status == RequestStatus.RUNNING]
        for request in running:
            request.drop_placeholder()
            self.scheduler.recompute(request)
            self.sampler.release(request)
        self.scheduler.suspects.add(running)
        return []

    def recompute_without_drafts(self, request: Request) -> None:
        """Send a drafted sample whose step turned non-finite back to be recomputed from its resolved tokens, its KV
        quarantined, its sampling state rebuilt from its tokens at its next draw, and drafting off for it.

        Args:
            request: the sample.
        """
        request.drop_placeholder()
        self.scheduler.block_manager.quarantine(request)
        self.scheduler.recompute(request)
        self.sampler.release(request)
        self.scheduler.drafter.poisoned(request)
