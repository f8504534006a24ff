"""The engine's step loop, held by `Engine`: `step()` reads as schedule -> run -> sample -> update.

With `overlap_scheduling` (the CUDA default) the update is split around the next step: a step's forward and sampling
are queued on the device, the scheduler `advance`s (computed tokens, one placeholder per sampled token), the next
step is scheduled and queued (its decode inputs read the placeholders' tokens on the device), and only then are the
first step's tokens copied to the host and `resolve`d (stop tokens, log-probs, outputs). A sample that stopped has
one wasted row in the step already queued. Anything that changes requests or weights from outside the loop
(`cancel`, a weight update, `close`) first `drain`s the step in flight, so it always sees resolved tokens.

Invariant: a group is in `open_groups` from `add` until its last sample's output; the outputs of a drained step wait
in `undelivered` until the next `step()` or `flush()`, so none is lost or overtaken.
"""

from __future__ import annotations

import logging
import time

import torch

from rollout.config import FieldError
from rollout.engine.counters import StepCounters
from rollout.engine.requests.outputs import GenerationOutput, progress_output
from rollout.engine.requests.request import Request, RequestStatus
from rollout.engine.runner.model_runner import ModelRunner
from rollout.engine.runner.step_inputs import UnresolvedTokens
from rollout.engine.sampling.broken_samples import end_broken
from rollout.engine.sampling.pending_samples import InFlightStep, PendingSamples, SamplerOutput
from rollout.engine.sampling.prompt_logprobs import deliver as deliver_prompt_logprobs
from rollout.engine.sampling.sampler import Sampler
from rollout.engine.scheduling.batch import ScheduledBatch
from rollout.engine.scheduling.block_manager import BlockManager
from rollout.engine.scheduling.scheduler import Scheduler
from rollout.engine.speculative.verify import (
    DrawRound,
    accept_drafts,
    rejected_slots,
    sample_drafted,
    withdraw_poisoned,
)
from rollout.engine.step_failures import StepFailures

logger = logging.getLogger("rollout.engine.engine")

NOTHING_TO_DRAW = (
    "no token can be drawn at this position: every token is banned (bad_words_ids, suppress_tokens, "
    "begin_suppress_tokens, no_repeat_ngram_size and min_new_tokens together leave none)"
)


class StepLoop:
    """Steps an engine's requests: the step in flight, the outputs not handed out yet, and the open groups."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
        overlap_scheduling: bool,
        return_logprobs: bool,
    ):
        """
        Args:
            scheduler: the engine's scheduler (its block manager holds the policy version the steps are tagged with).
            runner: runs a scheduled batch through the model.
            sampler: draws each row's token from the logits.
            overlap_scheduling: schedule step N+1 before step N's tokens reach the host.
            return_logprobs: compute each sampled token's log-prob.
        """
        self.scheduler = scheduler
        self.block_manager: BlockManager = scheduler.block_manager
        self.runner = runner
        self.sampler = sampler
        self.overlap_scheduling = overlap_scheduling
        self.return_logprobs = return_logprobs
        self.counters = StepCounters()
        self.in_flight: InFlightStep | None = None  # queued on the device, not resolved yet (overlap)
        self.undelivered: list[GenerationOutput] = []  # outputs of a drained step, for the next step()
        self.open_groups: dict[str, int] = {}  # group id -> samples not finished yet
        self.clear_drafts_on_update = False  # speculative_clear_on_weight_update
        self.failures = StepFailures(scheduler, sampler)  # what a failed step does to its samples

    # ---- requests in and out ----------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a prepared request (a group: itself and its forks).

        Raises:
            FieldError: ("group_id") its group is still running.
        """
        if request.group_id in self.open_groups:
            raise FieldError("group_id", f"{request.group_id!r} is already running")
        self.scheduler.add(request)
        self.open_groups[request.group_id] = request.num_forks + 1

    def cancel(self, *group_ids: str) -> list[GenerationOutput]:
        """Abort every unfinished sample of these groups: their outputs of the step in flight, then their aborted
        ones (one pass over the queues for all of them)."""
        self.drain()
        wanted = set(group_ids)
        drained = [output for output in self.undelivered if output.group_id in wanted]
        if drained:
            self.undelivered = [output for output in self.undelivered if output.group_id not in wanted]
        open_ids = [group_id for group_id in group_ids if group_id in self.open_groups]
        if not open_ids:
            return drained
        return drained + self.outputs(self.scheduler.abort(*open_ids))

    def has_unfinished(self) -> bool:
        """True while any request is queued or running, or outputs wait to be returned by `step()`."""
        return self.scheduler.has_unfinished() or self.in_flight is not None or bool(self.undelivered)

    def num_in_flight(self) -> int:
        """Samples that hold KV or sampled tokens, or whose step is still on the device."""
        return len(self.scheduler.in_flight()) or int(self.in_flight is not None)

    def end_all(self) -> None:
        """Abort every open group and drop the outputs not handed out yet (the engine is closing)."""
        self.drain()
        self.undelivered = []
        self.cancel(*self.open_groups)

    # ---- the loop ---------------------------------------------------------------------------------------------
    def step(self) -> list[GenerationOutput]:
        """One step (see `Engine.step`). Never raises: a failing forward ends the step's requests with an error."""
        outputs, self.undelivered = self.undelivered, []
        previous = self.in_flight  # stays reachable (for drain) until it is resolved, whatever raises meanwhile
        if previous is not None:
            self._advance(previous)
            if self._may_draft():  # drafts follow a sample's last token: it must be on the host
                self.counters.overlap_lost_steps += 1
                self.in_flight = None
                outputs += self._resolve(previous)
                previous = None
        batch = self.scheduler.schedule()
        outputs += self.outputs(batch.finished)
        launched, failure = None, None
        if not batch.is_empty:
            try:
                launched = self._launch(batch, previous)
            except Exception as error:  # noqa: BLE001 - the loop must survive any model failure
                logger.exception("engine step failed; ending its requests with an error")
                failure = error
        elif batch.swap_out or batch.zero_blocks:  # nothing computed: preempted KV still goes to the swap space
            self.runner.move_blocks(batch)
        if previous is not None:
            self.in_flight = None
            outputs += self._resolve(previous)
        if failure is not None:
            try:
                outputs += self.outputs(self.failures.after_failed_launch(batch, failure))
            finally:  # its traceback holds this frame: not the error too
                failure = None
        elif launched is not None and self.scheduler.suspects.requests:
            self.scheduler.suspects.sampled(batch)
        if launched is not None and (not self.overlap_scheduling or launched.logits is not None):
            self.counters.overlap_lost_steps += self.overlap_scheduling
            self._advance(launched)  # a drafted step is verified at once: its samples' next drafts need its tokens
            return outputs + self._resolve(launched)
        self.in_flight = launched
        return outputs

    def _launch(self, batch: ScheduledBatch, previous: InFlightStep | None) -> InFlightStep:
        """Queue a step's forward and sampling on the device; nothing here waits for the device."""
        unresolved = None
        if previous is not None:
            rows = {request: row for row, (request, _) in enumerate(previous.batch.samples)}
            unresolved = UnresolvedTokens(previous.samples.token_ids, rows)
        logits = self.runner.run(batch, unresolved)
        constrained = any(request.constraint is not None for request, _ in batch.samples)  # one check per step
        if constrained and previous is not None and previous.constrained:
            _accept_ahead(previous)  # while the device runs this step's forward
        drafts = batch.num_draft_tokens
        if drafts:  # with the draws its verification can make ahead, in one pass
            samples, ahead, ahead_rows = sample_drafted(self.sampler, logits, batch, self.return_logprobs)
        else:
            samples, ahead, ahead_rows = self.sampler.sample(logits, batch.samples, self.return_logprobs), None, {}
        chunks = [seq.num_tokens - len(seq.draft) if drafts else seq.num_tokens for seq in batch.sequences]
        # A decode computes one sampled token, the request's last (this step's placeholder is not added yet); a
        # one-token chunk of a prompt (a one-token prompt, a prefix-cache hit but one token, a chunked prefill's
        # last) or of a recompute that is not its last is prefill.
        decodes = sum(
            n == 1 and seq.request.num_prompt_tokens <= seq.start == len(seq.request.token_ids) - 1
            for n, seq in zip(chunks, batch.sequences)
        )
        self.counters.count_step(chunks, decodes, drafts)
        return InFlightStep(
            batch,
            samples,
            self.block_manager.policy_version,
            prompt_logprobs=self.runner.prompt_results,
            routes=self.runner.route_results,
            constrained=constrained,
            logits=logits if drafts else None,
            ahead=ahead,
            ahead_rows=ahead_rows,
        )

    def _may_draft(self) -> bool:
        """Whether the next step may draft (speculative decoding on, few enough samples running, and the drafter
        has a use for their tokens: `SuffixDrafter.wants_tokens`)."""
        drafter, scheduler = self.scheduler.drafter, self.scheduler
        if drafter is None or scheduler.waiting or scheduler.swapped:
            return False
        return len(scheduler.running) <= drafter.disable_by_batch_size and drafter.wants_tokens(scheduler.running)

    def _advance(self, step: InFlightStep) -> None:
        """Let the scheduler count what a queued step computes (once)."""
        if not step.advanced:
            self.scheduler.advance(step.batch, step.policy_version)
            step.advanced = True

    def _resolve(self, step: InFlightStep) -> list[GenerationOutput]:
        """Bring an advanced step's tokens to the host, put them in place (a drafted step: verify its drafts) and
        return its outputs."""
        progressed = self._resolve_tokens(step)
        if step.logits is not None:
            try:
                accept_drafts(
                    step.batch, step.logits, self._draw_round(step), self.scheduler.drafter, progressed,
                    ahead=step.ahead, ahead_rows=step.ahead_rows,
                )  # fmt: skip
            except Exception as error:  # noqa: BLE001 - the loop must survive any failure, its drafts' ones too
                logger.exception("verifying a drafted step failed; ending its drafted samples' groups with an error")
                drafted = [seq.request for seq in step.batch.sequences if seq.draft]
                for request in drafted:
                    request.drop_placeholder()
                progressed += self.failures.ended_with_error({request.group_id for request in drafted}, error)
            if self.block_manager.zero_new_blocks:  # the PyTorch attention reads whole blocks: no stale KV in them
                self.runner.kv_cache.zero_slots(rejected_slots(step.batch, self.block_manager.block_size))
            progressed = list(dict.fromkeys(progressed))  # one output per sample and step
        return self.outputs(progressed)

    def _draw_round(self, step: InFlightStep) -> DrawRound:
        """Draws one round of a drafted step's verification (`verify.DrawRound`), as a plain decode step would."""

        def draw(batch: ScheduledBatch, logits: torch.Tensor | SamplerOutput) -> list[Request]:
            if isinstance(logits, SamplerOutput):  # drawn ahead, with the step
                samples = PendingSamples.on_host(logits)
            else:
                samples = self.sampler.sample(logits, batch.samples, self.return_logprobs)
                self.counters.verification_draws += 1
            constrained = any(request.constraint is not None for request, _ in batch.samples)
            round_step = InFlightStep(batch, samples, step.policy_version, constrained=constrained, verifying=True)
            self._advance(round_step)
            if step.routes is not None:  # blocks the round filled (their routes came with the step): offered before
                step.routes.keep(batch, self.block_manager.cached_blocks)  # a sample's end frees them, as in a decode
            return self._resolve_tokens(round_step)

        return draw

    def _resolve_tokens(self, step: InFlightStep) -> list[Request]:
        """Bring an advanced step's tokens to the host and put them in place; returns the requests that have an
        output to give (ended, failed, or streaming)."""
        try:
            timed = step.logits is not None  # a drafted step: what of its period the device took (`StepCounters`)
            waited = time.perf_counter() if timed else 0.0
            sampled = step.samples.fetch()
            if timed:
                self.counters.drafted_wait_s += time.perf_counter() - waited
            deliver_prompt_logprobs(step.prompt_logprobs)  # before any output: a sample's first one carries them
            if step.routes is not None:
                step.routes.deliver(self.block_manager.cached_blocks)
        except Exception as error:  # noqa: BLE001 - a device failure surfaces here when the copy is waited for
            logger.exception("engine step failed; ending its requests with an error")
            for request, _ in step.batch.samples:
                request.drop_placeholder()
            return self.failures.ended_with_error({request.group_id for request, _ in step.batch.samples}, error)
        if sampled.broken_rows and (step.logits is not None or step.verifying):
            drafted = {id(seq.request) for seq in step.batch.sequences if seq.draft or step.verifying}
            poisoned = [row for row in sampled.broken_rows if id(step.batch.samples[row][0]) in drafted]
            if poisoned:
                sampled = withdraw_poisoned(step.batch, sampled, poisoned, self.failures.recompute_without_drafts)
        failed = end_broken(self.scheduler, self.block_manager, step.batch.samples, sampled.broken_rows)
        for index in sampled.dead_rows:  # nothing was drawable: end the sample, keep no meaningless token
            request = step.batch.samples[index][0]
            if not request.is_finished and not request.score_only:  # (a score-only one keeps no token anyway)
                request.drop_placeholder()
                reason = NOTHING_TO_DRAW
                if request.constraint is not None:
                    reason = request.constraint.dead_end_reason()
                failed += self.scheduler.fail(request, reason, request_fault=True)
        if sampled.top_logprobs is not None:
            for index, (request, _) in enumerate(step.batch.samples):
                if request.status != RequestStatus.FINISHED and request.sampling.top_logprobs:
                    request.top_logprobs.append(sampled.top_logprobs[index])
        resolved = self.scheduler.resolve(step.batch, sampled.token_ids, sampled.logprobs)
        self.counters.generated_tokens += sum(not r.score_only for r in resolved)  # (a score-only one keeps none)
        done = RequestStatus.FINISHED
        finished = [r for r in resolved if r.status == done]
        streaming = [r for r in resolved if r.streaming and r.status != done]
        return failed + finished + streaming

    def drain(self) -> None:
        """Finish the step in flight (its outputs wait for the next `step()` or `flush()`), so that the engine's
        state is final: done before anything changes requests or weights from outside the loop."""
        step, self.in_flight = self.in_flight, None
        if step is not None:
            self._advance(step)
            self.undelivered += self._resolve(step)

    def flush(self) -> list[GenerationOutput]:
        """Finish the step in flight, if any, and return every output not handed out yet."""
        self.drain()
        outputs, self.undelivered = self.undelivered, []
        return outputs

    def outputs(self, requests: list[Request]) -> list[GenerationOutput]:
        """Outputs for requests that progressed (`outputs.progress_output`); a finished sample gives back its
        sampling slot, and a group is forgotten when its last sample finishes."""
        outputs = [progress_output(request) for request in requests]
        drafter = self.scheduler.drafter
        for request in requests:
            if request.is_finished:
                self.sampler.release(request)
                self.runner.release(request)
                if drafter is not None:  # its tokens stay as drafts for its prompt
                    drafter.finished(request)
                self.open_groups[request.group_id] -= 1
                if self.open_groups[request.group_id] == 0:
                    del self.open_groups[request.group_id]
        return outputs


def _accept_ahead(previous: InFlightStep) -> None:
    """Bring the step before's tokens to the host early (the forward just queued keeps the device busy) and advance
    its open grammars past them, so this step's masks can be filled; the step is resolved as usual afterwards (its
    `accept` skips what was advanced here)."""
    sampled = previous.samples.fetch()
    dead = {*sampled.dead_rows, *sampled.broken_rows}
    for index, (request, _) in enumerate(previous.batch.samples):
        if request.constraint is not None and index not in dead and not request.is_finished:
            request.constraint.accept_ahead(sampled.token_ids[index])
