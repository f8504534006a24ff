"""One step's batch, built from the scheduler's queues within the step's token budget and sequence cap; the
scheduler (`scheduler.py`) runs the phases in its policy's order and owns the queues they move requests between.

- Running requests: the express lane's first (the lane's own sequence slots may put the running set past
  `max_num_seqs`: its samples are computed, the others in the slots left; a lane prompt's chunk leaves the decodes
  behind it a token each), then decodes, then unfinished prefill chunks, oldest first. When blocks run out, the
  running request that loses the fewest tokens (`admission.cheapest_victim`) is preempted (`Scheduler.preempt`).
- Swapped-out requests: swapped back in, oldest preemption first.
- Waiting requests (new or preempted), in arrival order, each through the admission gate
  (`rollout.engine.scheduling.admission`); one that cannot fit even in an empty cache ends with an error. Past one
  that does not fit, a short request may still be admitted through the express lane (`express_lane.py`).

A step that preempted admits nothing more (no ping-pong). A request whose chunk reaches its last token gets a logits
row; a group leader that just computed its prompt forks its other samples then, sharing every block.
"""

from __future__ import annotations

import time

from rollout.engine.requests.request import Request, RequestStatus, sample_id
from rollout.engine.scheduling.admission import cheapest_victim
from rollout.engine.scheduling.batch import ScheduledBatch, ScheduledSequence
from rollout.engine.scheduling.block_manager import cdiv
from rollout.engine.scheduling.express_lane import fork_share, life_blocks
from rollout.engine.scheduling.step_protocols import Drafter, SchedulerQueues
from rollout.engine.scheduling.waiting_cursor import WaitingCursor


class StepBuilder:
    """One step's batch as its phases fill it, and the token budget left (made by `Scheduler.schedule`, once per
    step)."""

    def __init__(self, scheduler: SchedulerQueues, solo: str | None = None):
        """
        Args:
            scheduler: whose queues, blocks and admission gate the step reads and moves requests between.
            solo: a suspect group (`suspects.py`): the step computes and admits its suspects alone. None: an ordinary
                step, which computes no suspect and admits no waiting request behind one.
        """
        self.scheduler = scheduler
        self.solo = solo
        self.batch = ScheduledBatch()
        self.budget = scheduler.max_batch_tokens  # tokens this step may still compute
        self.cursor = WaitingCursor(scheduler, solo)  # where `add_waiting` reads the waiting queue

    def add_running(self) -> None:
        """Add the running requests' next tokens, preempting when blocks run out."""
        scheduler, batch = self.scheduler, self.batch
        # Requests an earlier phase of this step scheduled ("prefill_first") are not scheduled again.
        scheduled_before = {id(seq.request) for seq in batch.sequences} | {id(request) for request, _ in batch.samples}
        # A request whose last (unresolved) token reached max_new_tokens computes nothing more: it only waits for
        # `resolve` to finish it, and is never preempted meanwhile (its output reports the KV it holds).
        finishing = False
        lane: list[Request] = []  # the express lane's samples, with anything to compute
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self._running():  # one pass, properties inlined: it runs for every running request at every step
            num_tokens = len(r.token_ids)
            if num_tokens - r.num_prompt_tokens >= r.max_new_tokens:  # r.reached_max_tokens
                finishing = True
            elif r.express_blocks and num_tokens > r.num_computed_tokens:
                lane.append(r)
            elif num_tokens - r.num_computed_tokens == 1:
                decodes.append(r)
            elif num_tokens - r.num_computed_tokens > 1:
                prefills.append(r)
        manager = scheduler.block_manager
        block_size, ref_counts = manager.block_size, manager.ref_counts
        sequences, samples, logits_sequences = batch.sequences, batch.samples, batch.logits_sequences
        drafter = scheduler.drafter
        # Drafts only in the long tail: a thin decoding batch with nothing queued (a queued request wants the blocks
        # and the token budget, and admitting it pays more).
        if drafter is not None and (
            scheduler.waiting or scheduler.swapped or not drafter.speculates(len(lane) + len(decodes))
        ):
            drafter = None
        # Decodes after the current one: drafts take only the budget they leave.
        later_decodes = len(lane) + len(decodes)
        for request in lane + decodes + prefills:  # each appears once: only scheduled_before can hold it already
            later_decodes -= 1
            if self.budget == 0 or len(sequences) >= scheduler.max_num_seqs:
                return
            if request.status is not RequestStatus.RUNNING or (scheduled_before and id(request) in scheduled_before):
                continue  # preempted by an older request in this loop, or scheduled already
            computed = request.num_computed_tokens
            remaining = len(request.token_ids) - computed
            if drafter is not None and remaining == 1 and self._add_drafted(drafter, request, max(later_decodes, 0)):
                continue
            if remaining == 1 and not request.num_forks and request.kv_version_min is not None:
                # Most decodes (a last token, not a one-token chunk of a longer prefill) write into a block the request
                # holds alone: nothing to allocate or fork (blocks_needed(request, 1) == 0, inlined: hot path).
                block_ids, index = request.block_ids, computed // block_size
                if index < len(block_ids) and ref_counts[block_ids[index]] <= 1:
                    samples.append((request, batch.next_row))
                    logits_sequences.append(len(sequences))
                    sequences.append(ScheduledSequence(request, computed, 1))
                    self.budget -= 1
                    continue
            num_new = min(remaining, self.budget)
            if request.express_blocks and remaining > 1:
                # A lane prefill chunk leaves the decodes behind it a token each, as when decodes came first: a prompt
                # as long as the lane's share (thousands of tokens) would take whole steps from every decode.
                seats = scheduler.max_num_seqs - len(sequences) - 1
                num_new = min(num_new, max(1, self.budget - min(len(decodes), seats)))
            needed = manager.blocks_needed(request, num_new)
            while not manager.can_allocate(needed):
                if finishing:
                    break  # their blocks come back when this step's previous one is resolved: wait, do not preempt
                scheduled = {id(seq.request) for seq in batch.sequences} | {id(r) for r, _ in batch.samples}
                victim = cheapest_victim(scheduler.running, scheduled, ref_counts, block_size)
                if victim is None:
                    break
                scheduler.preempt(victim, batch)
                if victim is request:
                    break
                needed = manager.blocks_needed(request, num_new)  # a freed sharer may spare a copy
            if request.status != RequestStatus.RUNNING or not manager.can_allocate(needed):
                continue
            self._add(request, num_new)
            self.budget -= num_new

    def add_swapped(self, reserve: int) -> None:
        """Swap swapped-out requests back in, oldest preemption first, while the admission gate lets them.

        Args:
            reserve: blocks kept free for the running requests' next step ("prefill_first").
        """
        scheduler, batch = self.scheduler, self.batch
        swapped, manager = scheduler.swapped, scheduler.block_manager
        while not batch.num_preempted and swapped and self.budget > 0 and len(batch.sequences) < scheduler.max_num_seqs:
            request = swapped[0]
            _check_resolved(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, self.budget)
            needed = len(request.swap_block_ids) + max(
                0, cdiv(request.num_computed_tokens + num_new, manager.block_size) - len(request.swap_block_ids)
            )
            chunk_end = request.num_computed_tokens + num_new
            if not scheduler.admission.admits(request, needed + reserve, scheduler.running, chunk_end, []):
                return
            swapped.popleft()
            batch.swap_in += manager.swap_in(request)
            # Back through the gate: no share of the lane (the lane let others into the share it left when swapped).
            request.express_blocks = 0
            request.status = RequestStatus.RUNNING
            scheduler.running.append(request)
            self._add(request, num_new)
            self.budget -= num_new

    def add_waiting(self, reserve: int) -> None:
        """Admit waiting requests (new or preempted) in arrival order, while the admission gate lets them.

        Args:
            reserve: blocks kept free for the running requests' next step ("prefill_first").
        """
        scheduler, batch = self.scheduler, self.batch
        manager, admission = scheduler.block_manager, scheduler.admission
        cursor = self.cursor
        express_only = False  # a request did not fit: only the express lane admits for the rest of this step
        while not batch.num_preempted and self.budget > 0:
            # Every sequence slot of the step is taken: the lane may still admit into its own slots, for the next
            # step to compute (first, as it computes the lane's samples).
            seated = len(batch.sequences) < scheduler.max_num_seqs
            if not seated and not admission.express_room(scheduler.running):
                return
            express_only = express_only or not seated
            request = cursor.next_admissible()
            if request is None:
                return
            lane = admission.express
            if express_only and (
                not lane.eligible(request)
                or life_blocks(request, manager.block_size) > admission.express_room(scheduler.running)
            ):
                # Not for the lane, or too long for its room: it waits for its turn (`waiting_cursor.py`: how far the
                # lane looks on behind it).
                cursor.skip_for_lane(request)
                if not admission.express_room(scheduler.running) or not cursor.within_scan():
                    return
                continue
            _check_resolved(request)
            # The last sampled token is never fed back, so a sample's KV holds at most prompt + max_new - 1 tokens.
            blocks_for_life = cdiv(request.num_prompt_tokens + request.max_new_tokens - 1, manager.block_size)
            if blocks_for_life > manager.num_blocks:
                scheduler.waiting.remove(request)
                scheduler.turns.forget(scheduler.waiting, {request.client})
                batch.finished += scheduler.finish(
                    request,
                    "error",
                    f"request needs {blocks_for_life} KV blocks (prompt + max_new_tokens - 1 tokens) but the cache "
                    f"has {manager.num_blocks}; raise num_blocks or lower max_new_tokens",
                )
                continue
            prefix_blocks, prefix_hashes = manager.match_prefix(request)
            if admission.waits_for_shared_prefill(request, len(prefix_blocks), scheduler.running):
                cursor.skip()
                continue
            num_computed = len(prefix_blocks) * manager.block_size
            num_new = min(request.num_tokens - num_computed, self.budget)
            needed = cdiv(num_computed + num_new, manager.block_size) - len(prefix_blocks)
            needed += manager.num_free_in(prefix_blocks)
            chunk_end = num_computed + num_new
            if express_only or not admission.admits(
                request, needed + reserve, scheduler.running, chunk_end, prefix_blocks
            ):
                if not admission.admits_express(request, reserve, scheduler.running):
                    if not admission.express_room(scheduler.running):
                        return
                    if not express_only and lane.closes_behind(request):
                        return  # it may only go in once nothing runs: nothing passes it
                    express_only = True  # a shorter request behind it may take the lane
                    cursor.skip()
                    if not cursor.within_scan():
                        return
                    continue
                express_only = True  # its growth is the lane's, which the gate's sums for this step do not hold
            else:
                request.express_blocks = 0  # admitted by the gate: no share of the lane (a sample readmitted)
            admission.admitted(request)
            scheduler.waiting.remove(request)
            if express_only:  # the lane admitted it, maybe past others
                scheduler.turns.passed(scheduler.waiting, request)
            else:
                scheduler.turns.took(request)
            # Its KV is computed anew, but for the cached prefix it takes: those blocks' version is the current one
            # (lookups match no other), fixed now, since a commit may come before its first step.
            request.admitted(manager.policy_version if prefix_blocks else None)
            manager.take_prefix(request, prefix_blocks, prefix_hashes)
            request.status = RequestStatus.RUNNING
            if request.started_time < 0:
                request.started_time = time.perf_counter()
            scheduler.running.append(request)
            if seated:
                self._add(request, num_new)
                self.budget -= num_new

    def _running(self) -> list[Request]:
        """The running requests this step may compute: all of them but suspects (`suspects.py`); a solo step only
        its group's suspects."""
        running, suspects = self.scheduler.running, self.scheduler.suspects.requests
        if not suspects:
            return running
        if self.solo is None:
            return [r for r in running if id(r) not in suspects]
        return [r for r in running if id(r) in suspects and r.group_id == self.solo]

    def _add_drafted(self, drafter: Drafter, request: Request, reserved: int) -> bool:
        """Schedule a decode with the draft tokens the drafter proposes for it, when it proposes some and their
        blocks are free (a draft never preempts anything, takes no block the running requests are known to grow into,
        nor the budget of the `reserved` decodes still to schedule); False: schedule it as a plain decode."""
        if request.num_forks or request.kv_version_min is None or request.has_placeholder:
            return False
        limit = min(self.budget - 1 - reserved, request.max_new_tokens - request.num_output_tokens - 1)
        draft = drafter.propose(request, limit) if limit > 0 else ()
        if not draft:
            return False
        scheduler = self.scheduler
        manager = scheduler.block_manager
        needed = manager.blocks_needed(request, 1 + len(draft))
        if needed and not manager.can_allocate(needed + scheduler.admission.known_growth(scheduler.running)):
            return False
        self._add(request, 1 + len(draft), draft)
        self.budget -= 1 + len(draft)
        return True

    def _add(self, request: Request, num_new: int, draft: tuple[int, ...] = ()) -> None:
        scheduler, batch = self.scheduler, self.batch
        manager = scheduler.block_manager
        batch.block_copies += manager.allocate(request, num_new)
        if request.kv_version_min is None:
            request.kv_version_min = manager.policy_version
        start = request.num_computed_tokens
        batch.sequences.append(ScheduledSequence(request, start, num_new, draft))
        if start + num_new - len(draft) < request.num_tokens:
            return  # a prefill chunk that does not reach the last token: no logits
        row = batch.next_row
        batch.logits_sequences.append(len(batch.sequences) - 1)
        batch.samples.append((request, row))
        batch.num_draft_tokens += len(draft)
        # A group leader that just computed its prompt forks its other samples, sharing every block.
        for index in range(1, request.num_forks + 1):
            child = request.fork(index, sample_id(request.group_id, index), scheduler.next_arrival())
            child.num_computed_tokens = start + num_new
            manager.fork(request, child)
            if request.express_blocks:  # a lane group's fork: its own share of the lane
                child.express_blocks = fork_share(request, manager.block_size)
            scheduler.running.append(child)
            batch.samples.append((child, row))
        request.num_forks = 0


def _check_resolved(request: Request) -> None:
    """A preempted request comes back only once its last token is known (a step that preempts admits nothing, and
    the step before is resolved before the next one is scheduled): prefix hashes and prefill inputs read it."""
    if request.has_placeholder:
        raise RuntimeError(f"request {request.request_id} was readmitted before its last token was resolved")
