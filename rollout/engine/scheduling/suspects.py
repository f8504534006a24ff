"""Samples under suspicion after a step failed to launch. Never imports torch.

A step whose launch raised (in the model's forward or in the sampler's preparation of its rows) may have failed
for one request's sake: ending every group in it would let one client's request end the others'. So, when a failed
step held several groups, the step loop sends each of its samples back to be recomputed and names them suspects
(`Suspects.add`). A suspect is then tried in a step of its own group (`solo_step`): nothing else runs in it, and the
other requests sit that step out. A suspect is cleared once a step of its own sampled it (`Suspects.sampled`): it
computed all it had to compute, its prompt's every chunk and its sampled row, with no other group beside it. One
whose own step fails is the request that failed, and the step loop ends its group with the error. A step that fails
with one group in it ends that group at once. So a request that fails every step it is in costs the others one
recompute, never their samples; a model that fails every step ends every group, one step each.

Invariants: a suspect is waiting or running, never swapped (`Scheduler.preempt` recomputes it); an ordinary step
neither computes a suspect nor admits a waiting request queued behind one (the queue's head waits, as one that does
not fit; the others run and free their blocks); at most one group is part way through its own steps (`solo_step`
takes it first), so a prompt chunked over several steps is not left to an ordinary step that would fail again.
"""

from __future__ import annotations

from rollout.engine.requests.request import Request, RequestStatus
from rollout.engine.scheduling.batch import ScheduledBatch
from rollout.engine.scheduling.step_builder import StepBuilder
from rollout.engine.scheduling.step_protocols import SchedulerQueues


class Suspects:
    """The samples of a failed step not yet sampled in a step of their own group (the scheduler's `suspects`)."""

    def __init__(self) -> None:
        # id(request) -> request (held, so that an id is never reused while it is here); empty in every step but
        # those after a failed launch.
        self.requests: dict[int, Request] = {}

    def add(self, requests: list[Request]) -> None:
        """Name the samples of a failed step suspects (they were sent back to be recomputed).

        Args:
            requests: the step's samples that were still running.
        """
        self.requests.update((id(request), request) for request in requests)

    def sampled(self, batch: ScheduledBatch) -> None:
        """A step launched: the samples it sampled are suspects no more.

        Args:
            batch: the step.
        """
        for request, _ in batch.samples:
            self.requests.pop(id(request), None)

    def solo_step(self, scheduler: SchedulerQueues) -> ScheduledBatch | None:
        """A step of one suspect group alone: the group part way through its own steps, else the one of the first
        admissible waiting suspect (None: none waits, or nothing of its group fits now; the scheduler then builds an
        ordinary step, which admits nothing past the suspect, and this one is tried again at the next).

        Args:
            scheduler: whose queues the step reads and changes.
        """
        # A suspect that ended meanwhile (cancelled, aborted by a weight update) is forgotten.
        self.requests = {key: r for key, r in self.requests.items() if r.status != RequestStatus.FINISHED}
        running = RequestStatus.RUNNING
        group = next((r.group_id for r in self.requests.values() if r.status == running), None)
        if group is None:  # the first that may be admitted (while admission is paused, one that sampled: it drains)
            admitting, suspects = scheduler.admitting, self.requests
            admissible = (r for r in scheduler.waiting if id(r) in suspects and (admitting or r.num_output_tokens))
            group = next((r.group_id for r in admissible), None)
        if group is None:
            return None
        step = StepBuilder(scheduler, solo=group)
        scheduler.admission.new_step()
        step.add_running()
        step.add_waiting(0)
        batch = step.batch
        if batch.is_empty and not (batch.finished or batch.swap_out or batch.num_preempted):
            return None
        return batch
