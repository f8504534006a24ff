"""Groups under suspicion after a step failed to launch. Never imports torch.

A step whose launch raised (in the model's forward or in the sampler's preparation of its rows) may have failed
for one request's sake: ending every group in it would let one client's request end the others'. So, when a failed
step held several groups, the step loop sends each of its samples back to be recomputed and names their groups
suspects (`Suspects.add`). A suspect is then tried in a step of its own (`solo_step`): nothing else runs in it, and
the other requests sit that step out. Until its turn comes a suspect is not admitted with others; the other
requests run as before. A suspect whose own step launches is cleared; one whose own step fails too is the request
that failed, and the step loop ends it with the error. A step that fails with one group in it ends that group at
once. So a request that fails every step it is in costs the others one recompute, never their samples; a model
that fails every step ends every group, one step each.
"""

from __future__ import annotations

from collections import deque

from rollout.engine.scheduling.batch import ScheduledBatch
from rollout.engine.scheduling.step_builder import SchedulerQueues, StepBuilder


class Suspects:
    """The groups of a failed step, each waiting for a step of its own (the scheduler's `suspects`)."""

    def __init__(self) -> None:
        self.groups: set[str] = set()  # group ids; empty in every step but those after a failed launch

    def add(self, group_ids: set[str]) -> None:
        """Name the groups of a failed step suspects (their samples were sent back to be recomputed).

        Args:
            group_ids: the step's groups.
        """
        self.groups |= group_ids

    def clear(self, group_ids: set[str]) -> None:
        """The groups' step launched (or they ended): they are suspects no more.

        Args:
            group_ids: the step's groups.
        """
        self.groups -= group_ids

    def solo_step(self, scheduler: SchedulerQueues) -> ScheduledBatch | None:
        """A step of the first waiting suspect group alone (None: no suspect waits, or its samples do not fit now;
        the scheduler then builds an ordinary step, without suspects, and this one is tried again at the next).

        Args:
            scheduler: whose queues the step reads and changes (restored but for what the step admitted).
        """
        waiting = scheduler.waiting
        present = {request.group_id for request in waiting if request.group_id in self.groups}
        self.groups &= present  # a suspect cancelled meanwhile is forgotten
        group = next((request.group_id for request in waiting if request.group_id in present), None)
        if group is None:
            return None
        running = scheduler.running
        scheduler.waiting = deque(request for request in waiting if request.group_id == group)
        scheduler.running = []
        self.groups.discard(group)  # (suspects are not admitted: this one is, now)
        step = StepBuilder(scheduler)
        scheduler.admission.new_step()
        try:
            step.add_waiting(0)
        finally:
            left = {id(request) for request in scheduler.waiting}
            scheduler.running = running + scheduler.running
            scheduler.waiting = deque(r for r in waiting if r.group_id != group or id(r) in left)
            self.groups.add(group)
            if step.batch.finished:  # ended (too big for the cache): its client keeps its other turns
                scheduler.turns.forget(scheduler.waiting, {request.client for request in step.batch.finished})
        if step.batch.is_empty and not step.batch.finished:
            return None
        return step.batch
