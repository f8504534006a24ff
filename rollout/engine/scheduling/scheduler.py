"""Token-budget scheduler. Never imports torch: it returns a plain `ScheduledBatch` and the model runner does the rest.

One rule covers prefill, chunked prefill and decode: a request computes as many of its uncomputed tokens as the
step's token budget allows (mixed batches fall out); a chunk that reaches its last token gets a sampled token.

Policies:
- "fifo": running requests first (decodes, then unfinished prefill chunks, oldest first), then swapped-out requests,
  then new requests in arrival order. Keeps decode latency low.
- "prefill_first": new requests first (with blocks reserved for the running ones' next step), then running ones.
  Maximises admission, at some cost in decode latency.

The scheduler owns the queues (waiting, swapped, running) and the moves between them: a step's phases, in the
policy's order, fill its batch (`step_builder.py`: admission, and which request to preempt). When blocks run out,
the running request with the fewest generated tokens not yet in this step is preempted: swapped to CPU blocks when
there are enough, else freed and recomputed later. A request (new, preempted or swapped out) is admitted only while
the free blocks also cover the expected growth of the running ones (`rollout.engine.scheduling.admission`). A
request that cannot fit even in an empty cache ends with an error.

Weight updates: `pause_admission()` admits only requests that sampled already, so the in-flight set drains;
`rollout.engine.weights.commit_modes` carries out the "recompute" and "abort" commit modes.
"""

from __future__ import annotations

from collections import deque

from rollout.engine.requests.request import Request, RequestStatus, sample_id
from rollout.engine.scheduling.admission import AdmissionGate
from rollout.engine.scheduling.batch import ScheduledBatch
from rollout.engine.scheduling.block_manager import BlockManager
from rollout.engine.scheduling.client_turns import ClientTurns
from rollout.engine.scheduling.step_builder import StepBuilder
from rollout.engine.scheduling.step_protocols import Drafter
from rollout.engine.scheduling.suspects import Suspects


class Scheduler:
    """Decides which requests compute which tokens each step and owns their KV blocks."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_batch_tokens: int,
        max_num_seqs: int,
        policy: str = "fifo",
    ):
        """
        Args:
            block_manager: the KV block pool this scheduler allocates from.
            max_batch_tokens: token budget per step.
            max_num_seqs: most sequences computed per step.
            policy: "fifo" or "prefill_first".
        """
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []
        self._arrivals = 0
        self.turns = ClientTurns()  # clients take turns in the waiting queue
        # New requests the express lane may take, in arrival order; some may have left the queue since
        # (`lane_candidates` drops them). The lane finds one here without scanning a long queue.
        self._lane_waiting: list[Request] = []
        self.num_preemptions = 0
        self.num_swaps = 0
        self.admission = AdmissionGate(block_manager, max_num_seqs, max_batch_tokens)
        # While False, only requests that already sampled tokens are (re)admitted (a "wait" weight update drains).
        self.admitting = True
        # Proposes draft tokens for thin decoding batches (speculative decoding); None: never.
        self.drafter: Drafter | None = None
        # The samples of a failed step, each group's tried in steps of its own (`suspects.py`).
        self.suspects = Suspects()

    # ---- queue management -------------------------------------------------------------------------------------
    def next_arrival(self) -> int:
        """A fresh arrival number (larger is newer)."""
        self._arrivals += 1
        return self._arrivals

    def add(self, request: Request) -> None:
        """Queue a new request (a group leader brings its samples with it through `num_forks`)."""
        request.arrival = self.next_arrival()
        self.turns.queue(self.waiting, request)
        if self.admission.express.eligible(request):
            self._lane_waiting.append(request)
            if len(self._lane_waiting) > 2 * len(self.waiting) + 64:  # those that left, dropped now and then
                self.lane_candidates()

    def lane_candidates(self) -> list[Request]:
        """The waiting requests the express lane may take (queued new, nothing sampled yet), in arrival order."""
        self._lane_waiting = [
            r for r in self._lane_waiting if r.status == RequestStatus.WAITING and r.num_output_tokens == 0
        ]
        return self._lane_waiting

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (new, preempted or swapped out)."""
        return len(self.waiting) + len(self.swapped)

    def has_unfinished(self) -> bool:
        """True while any request is waiting, swapped or running."""
        return bool(self.waiting or self.swapped or self.running)

    def in_flight(self) -> list[Request]:
        """Requests that hold KV or have sampled tokens: running, swapped, and preempted ones with output."""
        waiting = [r for r in self.waiting if r.num_output_tokens > 0]
        return self.running + list(self.swapped) + waiting

    def pause_admission(self) -> None:
        """Admit no request that has not sampled yet, until `resume_admission()`."""
        self.admitting = False

    def resume_admission(self) -> None:
        """Admit new requests again."""
        self.admitting = True

    def reset_for_recompute(self, request: Request) -> None:
        """Free the request's KV (device and swap) and put it at the head of the waiting queue (preemption, and a
        weight update's "recompute" commit mode)."""
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.block_hashes = []
        # kv_version_min stays until readmission: a sample that ends meanwhile (its last token was in flight) reports
        # the KV its tokens were computed on.
        request.status = RequestStatus.WAITING
        self.turns.requeued(request)  # at the head: new requests queue behind it
        self.waiting.appendleft(request)

    def recompute(self, request: Request) -> None:
        """Take a running request back to be recomputed from its tokens (its KV freed), ahead of the queue."""
        self.running.remove(request)
        self.reset_for_recompute(request)

    def abort(self, *group_ids: str, error: str | None = None) -> list[Request]:
        """End every sample of these groups with finish_reason "abort", or "error" saying `error` when given;
        returns them (unforked samples included). One pass over each queue, whatever the number of groups
        (thousands of cancels at once stay linear)."""
        wanted = set(group_ids)
        reason = "abort" if error is None else "error"
        ended: list[Request] = []
        for queue in (self.waiting, self.swapped):
            aborted = [r for r in queue if r.group_id in wanted]
            if aborted:
                kept = [r for r in queue if r.group_id not in wanted]
                queue.clear()
                queue.extend(kept)
                for request in aborted:
                    ended += self.finish(request, reason, error)
                if queue is self.waiting:  # from the list kept: one walk of the queue for every group aborted
                    self.turns.forget(kept, {request.client for request in aborted})
        aborted = [r for r in self.running if r.group_id in wanted]
        if aborted:
            self.running[:] = [r for r in self.running if r.group_id not in wanted]
            for request in aborted:
                ended += self.finish(request, reason, error)
        return ended

    def finish(
        self, request: Request, reason: str, error: str | None = None, request_fault: bool = False
    ) -> list[Request]:
        """Mark finished and free blocks. A leader whose samples were never forked ends them too, so a group always
        yields all n outputs (`request_fault`: the error is what the request asked for, `Request.request_fault`)."""
        ended = [request]
        for index in range(1, request.num_forks + 1):
            child = request.fork(index, sample_id(request.group_id, index), request.arrival)
            ended.append(child)
        request.num_forks = 0
        for r in ended:
            if r is request:
                self.block_manager.free(r)
            r.status = RequestStatus.FINISHED
            r.finish_reason = reason
            r.error, r.request_fault = error, request_fault
        return ended

    # ---- scheduling -------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick this step's work. Never raises on memory: it preempts, or ends requests that can never fit."""
        if self.suspects.requests:
            solo = self.suspects.solo_step(self)
            if solo is not None:
                solo.zero_blocks = self.block_manager.take_stale()
                return solo
        step = StepBuilder(self)
        self.admission.new_step()
        if self.policy == "prefill_first":
            reserve = sum(self.block_manager.blocks_needed(r, 1) for r in self.running if not r.reached_max_tokens)
            step.add_swapped(reserve)
            step.add_waiting(reserve)
            step.add_running()
        else:
            step.add_running()
            step.add_swapped(0)
            step.add_waiting(0)
        step.batch.zero_blocks = self.block_manager.take_stale()  # freed up to now, this step's preemptions included
        return step.batch

    def preempt(self, request: Request, batch: ScheduledBatch) -> None:
        """Take a running request out for this step (`StepBuilder.add_running`, when blocks run out): swapped to CPU
        blocks when there are enough, else freed to be recomputed later.

        Args:
            request: the victim, running.
            batch: the step being built (it counts the preemption and carries the swap-out).
        """
        self.running.remove(request)
        self.num_preemptions += 1
        self.admission.growth.preempted()
        batch.num_preempted += 1
        # Swap only when this step swapped nothing in: a swap-in frees CPU blocks that are read by this step's
        # copies, and swap-outs are executed first. A suspect is recomputed: it is never swapped (`suspects.py`).
        suspect = id(request) in self.suspects.requests
        if not batch.swap_in and not suspect and self.block_manager.can_swap_out(request):
            batch.swap_out += self.block_manager.swap_out(request)
            request.status = RequestStatus.SWAPPED
            self.swapped.appendleft(request)
            self.num_swaps += 1
            return
        self.reset_for_recompute(request)

    # ---- results ----------------------------------------------------------------------------------------------
    # A step's results arrive in two parts, so that the next step can be scheduled while this one still runs
    # (overlapped scheduling): `advance` once its forward is queued, `resolve` once its sampled tokens reach the host.
    # Between the two, each sample's last token is a placeholder, and the only work ever scheduled for such a request
    # is the decode of that token (its input id is taken on the device): never a re-prefill, a hash or a fork.
    def advance(self, batch: ScheduledBatch, policy_version: int) -> None:
        """Record what a queued step computes: tokens computed, full blocks offered for prefix reuse, one placeholder
        token per sample. Requests that finished meanwhile (a stop token of the step before) are skipped.

        Args:
            batch: the step, as scheduled.
            policy_version: the weights' version that runs the step (tags the tokens it samples).
        """
        manager = self.block_manager
        block_size = manager.block_size
        finished = RequestStatus.FINISHED
        drafted = batch.num_draft_tokens > 0
        for seq in batch.sequences:  # runs for every sequence at every step
            request = seq.request
            if request.status != finished:
                computed = seq.start + seq.num_tokens
                if drafted:  # a drafted sequence's drafts count once the verification accepts them, one by one
                    computed -= len(seq.draft)
                request.num_computed_tokens = computed
                if computed >= (len(request.block_hashes) + 1) * block_size:  # a block became full
                    manager.commit_hashes(request)
                if computed == len(request.token_ids):  # its chunk reached its last token: it was sampled
                    request.add_placeholder(policy_version)
        if len(batch.samples) > len(batch.logits_sequences):  # forked samples share their leader's row
            leaders = {id(batch.sequences[index].request) for index in batch.logits_sequences}
            for request, _ in batch.samples:
                if id(request) not in leaders and request.status != finished:
                    request.add_placeholder(policy_version)

    def resolve(self, batch: ScheduledBatch, sampled_tokens: list[int], logprobs: list | None = None) -> list[Request]:
        """Put an advanced step's sampled tokens (and log-probs) in place of the placeholders; end requests they stop.

        Args:
            batch: the step, as passed to `advance`.
            sampled_tokens: one token per `batch.samples` entry (entries of finished requests are ignored).
            logprobs: the tokens' log-probs, in the same order (None: not computed).
        Returns:
            The requests that got their token, in `batch.samples` order (those it ended among them).
        """
        resolved: list[Request] = []
        done = RequestStatus.FINISHED
        for index, (request, _) in enumerate(batch.samples):
            if request.status == done:
                continue
            request.resolve_token(sampled_tokens[index], None if logprobs is None else logprobs[index])
            resolved.append(request)
            if request.finish_reason is not None:
                self.admission.finished(request)
                self._dequeue(request)
                self.finish(request, request.finish_reason, request.error)  # it forked already: it ends alone
        return resolved

    def fail(self, request: Request, error: str, request_fault: bool = False) -> list[Request]:
        """End one sample with finish_reason "error" wherever it is queued; returns it (with unforked samples).
        `request_fault`: the error is what the request asked for (`Request.request_fault`), not the engine's."""
        self._dequeue(request)
        return self.finish(request, "error", error, request_fault)

    def _dequeue(self, request: Request) -> None:
        """Take a request out of whichever queue holds it (it may have been preempted since it was sampled)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)
