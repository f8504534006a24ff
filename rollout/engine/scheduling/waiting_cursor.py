"""`WaitingCursor`: where one step reads the waiting queue while it admits (`StepBuilder.add_waiting`), and how far
the express lane looks past a request that did not fit. Never imports torch.

The step admits in turn order from the queue's head. Past a request that does not fit, only the express lane admits
(`express_lane.py`), and it looks `EXPRESS_SCAN` requests further; a run of preempted samples at the head (they
sampled: never the lane's) is jumped in one pass and does not count. Past the scan the cursor jumps straight to the
next request the lane may take (the scheduler keeps those apart: `Scheduler.lane_candidates`), at most
`EXPRESS_SCAN` times a step, so that a queue of long groups from many clients never hides a short request, and a
step never scans a long queue.
"""

from __future__ import annotations

import itertools

from rollout.engine.requests.request import Request, RequestStatus
from rollout.engine.scheduling.step_protocols import SchedulerQueues

EXPRESS_SCAN = 32  # waiting requests a step looks at, past one that did not fit, for one the express lane admits


class WaitingCursor:
    """One step's position in the waiting queue (made by `StepBuilder`, once per step)."""

    def __init__(self, scheduler: SchedulerQueues, solo: str | None):
        """
        Args:
            scheduler: whose waiting queue, suspects and lane candidates the step reads.
            solo: the suspect group a solo step admits alone (`suspects.py`); None: an ordinary step.
        """
        self.scheduler = scheduler
        self.solo = solo
        self.skipped = 0  # waiting requests passed over this step (they wait for their turn or for a shared block)
        self.scan_end = EXPRESS_SCAN  # the lane looks no further (moved on past preempted samples it jumps)
        self.jumps = 0  # made past the scan, to the requests the lane may take
        self._lane_ids: set[int] | None = None  # the waiting requests the lane may take (read once a step)

    def next_admissible(self) -> Request | None:
        """The first waiting request that may be admitted now (while admission is paused: one that sampled), past
        the `skipped` ones. While there are suspects, a solo step admits only its group's; an ordinary step only
        the requests ahead of the first waiting one (it waits as a queue head that does not fit), and none while
        a suspect group is part way through its own steps (the blocks it needs are not given to others)."""
        scheduler, skip = self.scheduler, self.skipped
        waiting, suspects, admitting = scheduler.waiting, scheduler.suspects.requests, scheduler.admitting
        if admitting and not suspects:
            return waiting[skip] if skip < len(waiting) else None
        admissible = (r for r in waiting if admitting or r.num_output_tokens > 0)
        if self.solo is not None:
            admissible = (r for r in admissible if id(r) in suspects and r.group_id == self.solo)
        elif suspects:
            if any(r.status == RequestStatus.RUNNING for r in suspects.values()):
                return None
            admissible = itertools.takewhile(lambda r: id(r) not in suspects, admissible)
        return next(itertools.islice(admissible, skip, None), None)

    def skip(self) -> None:
        """Pass the request at the cursor: it waits (for a block another request is computing, or for its turn while
        the lane looks on behind it)."""
        self.skipped += 1

    def skip_for_lane(self, request: Request) -> None:
        """Pass the request at the cursor, which is not for the lane: it waits for its turn, and the lane looks on
        past it. A preempted sample there is the first of a run of them (a big group's, by the hundred): the run is
        passed in one go, without counting in the scan.

        Args:
            request: the request at the cursor.
        """
        past = self._past_sampled() if request.num_output_tokens else self.skipped + 1
        self.scan_end += past - self.skipped - 1
        self.skipped = past

    def within_scan(self) -> bool:
        """Whether the cursor is within the lane's scan, after jumping past its end to the next request the lane may
        take when it is not (False: none, or `EXPRESS_SCAN` jumps made this step, or a step that is not an ordinary
        one, where `next_admissible` counts in a filtered queue)."""
        if self.skipped < self.scan_end:
            return True
        self.jumps += 1
        scheduler = self.scheduler
        if self.jumps > EXPRESS_SCAN or not scheduler.admitting or scheduler.suspects.requests or self.solo is not None:
            return False
        if self._lane_ids is None:  # once a step
            self._lane_ids = {id(request) for request in scheduler.lane_candidates()}
        wanted = self._lane_ids
        if wanted:
            for index, request in enumerate(itertools.islice(scheduler.waiting, self.skipped, None), self.skipped):
                if id(request) in wanted:
                    self.skipped, self.scan_end = index, index + 1
                    return True
        return False

    def _past_sampled(self) -> int:
        """The queue index of the first waiting request, from the cursor on, that has sampled nothing; one past the
        cursor outside an ordinary step (`next_admissible` then counts in a filtered queue)."""
        scheduler, index = self.scheduler, self.skipped
        if not scheduler.admitting or scheduler.suspects.requests:
            return index + 1
        for request in itertools.islice(scheduler.waiting, index, None):
            if not request.num_output_tokens:
                break
            index += 1
        return index
