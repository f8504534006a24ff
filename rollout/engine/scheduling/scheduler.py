"""Token-budget scheduler. Never imports torch: it returns a plain `ScheduledBatch` and the model runner does the rest.

One rule covers prefill, chunked prefill and decode: a request computes as many of its uncomputed tokens as the
step's token budget allows (mixed batches fall out); a chunk that reaches its last token gets a sampled token.

Policies:
- "fifo": running requests first (decodes, then unfinished prefill chunks, oldest first), then swapped-out requests,
  then new requests in arrival order. Keeps decode latency low.
- "prefill_first": new requests first (with blocks reserved for the running ones' next step), then running ones.
  Maximises admission, at some cost in decode latency.

When blocks run out, the running request with the fewest generated tokens not yet in this step is preempted: swapped
to CPU blocks when there are enough, else freed and recomputed later. A request (new, preempted or swapped out) is
admitted only while the free blocks also cover the expected growth of the running ones
(`rollout.engine.scheduling.admission`). A request that cannot fit even in an empty cache ends with an error.

Weight updates: `pause_admission()` admits only requests that sampled already, so the in-flight set drains;
`rollout.engine.weights.commit_modes` carries out the "recompute" and "abort" commit modes.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from rollout.engine.requests.request import Request, RequestStatus, sample_id
from rollout.engine.scheduling.admission import AdmissionGate, cheapest_victim
from rollout.engine.scheduling.batch import ScheduledBatch, ScheduledSequence
from rollout.engine.scheduling.block_manager import BlockManager, cdiv


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
        self.num_preemptions = 0
        self.num_swaps = 0
        self.admission = AdmissionGate(block_manager, max_num_seqs)
        # While False, only requests that already sampled tokens are (re)admitted (a "wait" weight update drains).
        self.admitting = True

    # ---- queue management -------------------------------------------------------------------------------------
    def next_arrival(self) -> int:
        """A fresh arrival number (larger is newer)."""
        self._arrivals += 1
        return self._arrivals

    def add(self, request: Request) -> None:
        """Queue a new request (a group leader brings its samples with it through `num_forks`)."""
        request.arrival = self.next_arrival()
        self.waiting.append(request)

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
        self.waiting.appendleft(request)

    def abort(self, group_id: str) -> list[Request]:
        """End every sample of `group_id` with finish_reason "abort"; returns them (unforked samples included)."""
        ended: list[Request] = []
        for queue in (self.waiting, self.swapped):
            for request in [r for r in queue if r.group_id == group_id]:
                queue.remove(request)
                ended += self.finish(request, "abort")
        for request in [r for r in self.running if r.group_id == group_id]:
            self.running.remove(request)
            ended += self.finish(request, "abort")
        return ended

    def finish(self, request: Request, reason: str, error: str | None = None) -> list[Request]:
        """Mark finished and free blocks. A leader whose samples were never forked ends them too, so a group always
        yields all n outputs."""
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
            r.error = error
        return ended

    # ---- scheduling -------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick this step's work. Never raises on memory: it preempts, or ends requests that can never fit."""
        batch = ScheduledBatch()
        budget = [self.max_batch_tokens]
        self.admission.new_step()
        if self.policy == "prefill_first":
            reserve = sum(self.block_manager.blocks_needed(r, 1) for r in self.running if not r.reached_max_tokens)
            self._schedule_swapped(batch, budget, reserve)
            self._schedule_waiting(batch, budget, reserve)
            self._schedule_running(batch, budget)
        else:
            self._schedule_running(batch, budget)
            self._schedule_swapped(batch, budget, 0)
            self._schedule_waiting(batch, budget, 0)
        batch.zero_blocks = self.block_manager.take_stale()  # freed up to now, this step's preemptions included
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: list[int]) -> None:
        # Requests an earlier phase of this step scheduled ("prefill_first") are not scheduled again.
        scheduled_before = {id(seq.request) for seq in batch.sequences} | {id(request) for request, _ in batch.samples}
        # A request whose last (unresolved) token reached max_new_tokens computes nothing more: it only waits for
        # `resolve` to finish it, and is never preempted meanwhile (its output reports the KV it holds).
        finishing = False
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:  # one pass, properties inlined: it runs for every running request at every step
            num_tokens = len(r.token_ids)
            if num_tokens - r.num_prompt_tokens >= r.max_new_tokens:  # r.reached_max_tokens
                finishing = True
            elif num_tokens - r.num_computed_tokens == 1:
                decodes.append(r)
            elif num_tokens - r.num_computed_tokens > 1:
                prefills.append(r)
        block_size, ref_counts = self.block_manager.block_size, self.block_manager.ref_counts
        sequences, samples, logits_sequences = batch.sequences, batch.samples, batch.logits_sequences
        for request in decodes + prefills:  # each appears once: only scheduled_before can hold it already
            if budget[0] == 0 or len(sequences) >= self.max_num_seqs:
                return
            if request.status is not RequestStatus.RUNNING or (scheduled_before and id(request) in scheduled_before):
                continue  # preempted by an older request in this loop, or scheduled already
            computed = request.num_computed_tokens
            remaining = len(request.token_ids) - computed
            if remaining == 1 and not request.num_forks and request.kv_version_min is not None:
                # Most decodes (a last token, not a one-token chunk of a longer prefill) write into a block the request
                # holds alone: nothing to allocate or fork (blocks_needed(request, 1) == 0, inlined: hot path).
                block_ids, index = request.block_ids, computed // block_size
                if index < len(block_ids) and ref_counts[block_ids[index]] <= 1:
                    samples.append((request, len(logits_sequences)))
                    logits_sequences.append(len(sequences))
                    sequences.append(ScheduledSequence(request, computed, 1))
                    budget[0] -= 1
                    continue
            num_new = min(remaining, budget[0])
            needed = self.block_manager.blocks_needed(request, num_new)
            while not self.block_manager.can_allocate(needed):
                if finishing:
                    break  # their blocks come back when this step's previous one is resolved: wait, do not preempt
                scheduled = {id(seq.request) for seq in batch.sequences} | {id(r) for r, _ in batch.samples}
                victim = cheapest_victim(self.running, scheduled, ref_counts, block_size)
                if victim is None:
                    break
                self._preempt(victim, batch)
                if victim is request:
                    break
                needed = self.block_manager.blocks_needed(request, num_new)  # a freed sharer may spare a copy
            if request.status != RequestStatus.RUNNING or not self.block_manager.can_allocate(needed):
                continue
            self._add_to_batch(batch, request, num_new)
            budget[0] -= num_new

    def _schedule_swapped(self, batch: ScheduledBatch, budget: list[int], reserve: int) -> None:
        while not batch.num_preempted and self.swapped and budget[0] > 0 and len(batch.sequences) < self.max_num_seqs:
            request = self.swapped[0]
            _check_resolved(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget[0])
            needed = len(request.swap_block_ids) + max(
                0,
                cdiv(request.num_computed_tokens + num_new, self.block_manager.block_size)
                - len(request.swap_block_ids),
            )
            if not self.admission.admits(request, needed + reserve, self.running):
                return
            self.swapped.popleft()
            batch.swap_in += self.block_manager.swap_in(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_to_batch(batch, request, num_new)
            budget[0] -= num_new

    def _schedule_waiting(self, batch: ScheduledBatch, budget: list[int], reserve: int) -> None:
        manager = self.block_manager
        deferred = 0  # waiting requests passed over this step (they wait for a block another request computes)
        while not batch.num_preempted and budget[0] > 0 and len(batch.sequences) < self.max_num_seqs:
            request = self._next_admissible(deferred)
            if request is None:
                return
            _check_resolved(request)
            # The last sampled token is never fed back, so a sample's KV holds at most prompt + max_new - 1 tokens.
            blocks_for_life = cdiv(request.num_prompt_tokens + request.max_new_tokens - 1, manager.block_size)
            if blocks_for_life > manager.num_blocks:
                self.waiting.remove(request)
                batch.finished += self.finish(
                    request,
                    "error",
                    f"request needs {blocks_for_life} KV blocks (prompt + max_new_tokens - 1 tokens) but the cache "
                    f"has {manager.num_blocks}; raise num_blocks or lower max_new_tokens",
                )
                continue
            prefix_blocks, prefix_hashes = manager.match_prefix(request)
            if self.admission.waits_for_shared_prefill(request, len(prefix_blocks), self.running):
                deferred += 1
                continue
            num_computed = len(prefix_blocks) * manager.block_size
            num_new = min(request.num_tokens - num_computed, budget[0])
            needed = cdiv(num_computed + num_new, manager.block_size) - len(prefix_blocks)
            needed += manager.num_free_in(prefix_blocks)
            if not self.admission.admits(request, needed + reserve, self.running):
                return
            self.admission.admitted(request)
            self.waiting.remove(request)
            request.kv_version_min = None  # its KV is computed anew: under the current weights
            manager.take_prefix(request, prefix_blocks, prefix_hashes)
            request.status = RequestStatus.RUNNING
            if request.started_time < 0:
                request.started_time = time.perf_counter()
            self.running.append(request)
            self._add_to_batch(batch, request, num_new)
            budget[0] -= num_new

    def _next_admissible(self, skip: int) -> Request | None:
        """The first waiting request that may be admitted now (while admission is paused: one that sampled), past
        the first `skip` of them."""
        if self.admitting:
            return self.waiting[skip] if skip < len(self.waiting) else None
        return next(itertools.islice((r for r in self.waiting if r.num_output_tokens > 0), skip, None), None)

    def _add_to_batch(self, batch: ScheduledBatch, request: Request, num_new: int) -> None:
        batch.block_copies += self.block_manager.allocate(request, num_new)
        if request.kv_version_min is None:
            request.kv_version_min = self.block_manager.policy_version
        start = request.num_computed_tokens
        batch.sequences.append(ScheduledSequence(request, start, num_new))
        if start + num_new < request.num_tokens:
            return  # a prefill chunk that does not reach the last token: no logits
        row = len(batch.logits_sequences)
        batch.logits_sequences.append(len(batch.sequences) - 1)
        batch.samples.append((request, row))
        # A group leader that just computed its prompt forks its other samples, sharing every block.
        for index in range(1, request.num_forks + 1):
            child = request.fork(index, sample_id(request.group_id, index), self.next_arrival())
            child.num_computed_tokens = start + num_new
            self.block_manager.fork(request, child)
            self.running.append(child)
            batch.samples.append((child, row))
        request.num_forks = 0

    def _preempt(self, request: Request, batch: ScheduledBatch) -> None:
        self.running.remove(request)
        self.num_preemptions += 1
        self.admission.growth.preempted()
        batch.num_preempted += 1
        # Swap only when this step swapped nothing in: a swap-in frees CPU blocks that are read by this step's
        # copies, and swap-outs are executed first.
        if not batch.swap_in and self.block_manager.can_swap_out(request):
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
        for seq in batch.sequences:  # runs for every sequence at every step
            request = seq.request
            if request.status != finished:
                request.num_computed_tokens = computed = seq.start + seq.num_tokens
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
                self.admission.growth.finished(request.num_output_tokens)
                self._dequeue(request)
                self.finish(request, request.finish_reason, request.error)  # it forked already: it ends alone
        return resolved

    def fail(self, request: Request, error: str) -> list[Request]:
        """End one sample with finish_reason "error" wherever it is queued; returns it (with unforked samples)."""
        self._dequeue(request)
        return self.finish(request, "error", error)

    def _dequeue(self, request: Request) -> None:
        """Take a request out of whichever queue holds it (it may have been preempted since it was sampled)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        else:
            self.waiting.remove(request)


def _check_resolved(request: Request) -> None:
    """A preempted request comes back only once its last token is known (a step that preempts admits nothing, and
    the step before is resolved before the next one is scheduled): prefix hashes and prefill inputs read it."""
    if request.has_placeholder:
        raise RuntimeError(f"request {request.request_id} was readmitted before its last token was resolved")
