"""What `rollout-bench long-tail` reads of a running engine beyond its counters, and the stubbed model's forward.

`Probe` wraps some of the engine's instance attributes (it changes nothing the engine does): the scheduler's
`schedule` (each step's batch: sequences that decode, blocks swapped out and in, running requests), the block
manager's `take_prefix` (every admission: how many of the request's tokens the prefix cache already held, and whether
the request was admitted before, i.e. is readmitted after a preemption by recompute), and the clocks of `step` and
of the model runner's forward (the engine's own host work is the difference, on a CPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from rollout.benchmarks.harness.stub_model import VOCAB as STUB_VOCAB
from rollout.engine.engine import Engine

__all__ = ["STUB_VOCAB", "Probe", "stub_forward"]


def stub_forward(engine: Engine, max_rows: int) -> None:
    """Replace the engine's model forward (prefill and decode) by ready logits, as `host_time` does: a step costs the
    engine's own host work (scheduling, inputs, attention metadata, sampling, outputs) and no model compute."""
    logits = torch.randn(max_rows, STUB_VOCAB, generator=torch.Generator().manual_seed(0))

    def forward(input_ids: torch.Tensor, positions: Any, metadata: Any, keep: torch.Tensor) -> torch.Tensor:
        return logits[: keep.numel()]

    engine.runner._forward = forward  # noqa: SLF001 - the measurement leaves out exactly the model's forward
    engine.runner._decode_forward = forward  # noqa: SLF001


class Probe:
    """Per-step and per-admission figures the engine does not count.

    Attributes:
        steps: schedules that computed something (equals the engine's `counters.steps`).
        decoding: sum over those steps of the sequences that computed exactly one token (decodes).
        sequences: sum over those steps of all sequences computed (decodes and prefill chunks).
        running: sum over those steps of the scheduler's running requests after scheduling.
        queued_steps, queued_decoding: the steps (and their decodes) taken while some request still waited for
            admission (new, preempted or swapped out): the batch the scheduler keeps while work is queued.
        swap_out_blocks, swap_in_blocks: KV blocks copied to and from the CPU swap space.
        first_admission_tokens: sum over requests of the tokens left to compute at their first admission (prompt
            minus the prefix-cache hit then).
        first_admission_hits: sum of those prefix-cache hits.
        readmissions: admissions of a request admitted before (recompute after preemption).
        readmission_tokens, readmission_hits: its tokens then (prompt + output so far) and how many of them the
            prefix cache still held (its own freed blocks, or its group's prompt).
        recomputed_by_position: tokens computed at a position the same request had already computed (or found in
            the prefix cache at its first admission): an independent count of the recomputed tokens, from the
            batches rather than the engine's counters.
        max_admissions: the most times one request was admitted.
        tail_steps, tail_rows, tail_tokens: the steps that decoded at most `tail_width` samples and computed
            nothing else (the long tail), the samples they decoded, and the tokens they generated: `tail_rows /
            tail_tokens` is the model forward passes per generated token a sample sees in the tail (1 without
            speculative decoding, less when drafts are accepted).
        draft_tokens: draft tokens computed (speculative decoding), accepted or not.
        tail_plain_s, tail_plain_steps, tail_drafted_s, tail_drafted_steps: the tail steps without and with draft
            tokens, and the seconds from each one's schedule to the next step's (the loop's period while it ran). With
            overlapped scheduling a plain step's host work hides under the device's, so its period is the larger of
            the two, except where the drafter wanted the step before's tokens first (then a plain step waits too);
            a drafted step is verified at once, so its period is their sum. On a GPU, the plain steps of a run
            without drafts against the drafted steps of a run with them tell what a drafted step costs.
        step_s, forward_s: seconds spent in the engine's `step` calls, and in its model runner's forward calls
            within them (on a CPU the forward's compute; on a GPU only what queuing it costs, and a replayed CUDA
            graph does not call it): `step_s - forward_s` is the engine's own host work, on a CPU.
    """

    def __init__(self, engine: Engine, tail_width: int = 8):
        self.engine = engine
        self.tail_width = tail_width
        self.tail_steps = self.tail_rows = self.tail_tokens = self.draft_tokens = 0
        self.tail_plain_steps = self.tail_drafted_steps = 0
        self.tail_plain_s = self.tail_drafted_s = 0.0
        self._period: tuple[str, float] | None = None  # the kind of the last step scheduled, and when it was
        # Tail steps scheduled and not resolved yet, by id (held, so no id is reused meanwhile): the tokens each
        # generates are counted when the step loop resolves it, which with overlapped scheduling comes after the next
        # schedule, and before it when drafts need the tokens.
        self._open_tail: dict[int, Any] = {}
        self.steps = self.decoding = self.sequences = self.running = 0
        self.queued_steps = self.queued_decoding = 0
        self.swap_out_blocks = self.swap_in_blocks = 0
        self.first_admission_tokens = self.first_admission_hits = 0
        self.readmissions = self.readmission_tokens = self.readmission_hits = 0
        self.recomputed_by_position = 0
        self.step_s = self.forward_s = 0.0
        self._covered: dict[str, int] = {}  # request id -> positions computed or prefix-hit so far (high-water mark)
        self._admissions: dict[str, int] = {}
        schedule, take_prefix = engine.scheduler.schedule, engine.block_manager.take_prefix

        def probed_schedule() -> Any:
            self.close_step()
            started = time.perf_counter()
            batch = schedule()
            self._count_batch(batch, started)
            return batch

        def probed_take_prefix(request: Any, blocks: list[int], hashes: list[int]) -> None:
            take_prefix(request, blocks, hashes)
            self._count_admission(request)

        resolve = engine.loop._resolve  # noqa: SLF001 - counted, not changed

        def probed_resolve(step: Any) -> Any:
            before = engine.counters.generated_tokens
            try:
                return resolve(step)
            finally:
                if self._open_tail.pop(id(step.batch), None) is not None:
                    self.tail_tokens += engine.counters.generated_tokens - before

        engine.scheduler.schedule = probed_schedule  # instance attributes: the engine's code is unchanged
        engine.loop._resolve = probed_resolve  # noqa: SLF001
        engine.block_manager.take_prefix = probed_take_prefix
        engine.step = self._clocked(engine.step, "step_s")
        runner = engine.runner
        forward = self._clocked(runner._forward, "forward_s")  # noqa: SLF001 - timed, not changed
        # One wrapper where they are one function (the runner tells a compiled decode forward by that).
        decode = runner._decode_forward  # noqa: SLF001
        decode = forward if decode is runner._forward else self._clocked(decode, "forward_s")  # noqa: SLF001
        runner._forward, runner._decode_forward = forward, decode  # noqa: SLF001

    def _clocked(self, function: Callable, seconds: str) -> Callable:
        """`function`, adding the seconds each call takes to this probe's attribute `seconds`."""

        def clocked(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                setattr(self, seconds, getattr(self, seconds) + time.perf_counter() - start)

        return clocked

    @property
    def max_admissions(self) -> int:
        return max(self._admissions.values(), default=0)

    def close_step(self) -> None:
        """End the last scheduled tail step's period (called before each schedule, and once at the end)."""
        if self._period is not None:
            kind, started = self._period
            setattr(self, kind, getattr(self, kind) + time.perf_counter() - started)
            self._period = None

    def _count_admission(self, request: Any) -> None:
        rid, hit = request.request_id, request.num_computed_tokens
        admissions = self._admissions[rid] = self._admissions.get(rid, 0) + 1
        if admissions == 1:
            self._covered[rid] = hit
            self.first_admission_tokens += request.num_tokens - hit
            self.first_admission_hits += hit
        else:
            self.readmissions += 1
            self.readmission_tokens += request.num_tokens
            self.readmission_hits += hit

    def _count_batch(self, batch: Any, started: float) -> None:
        self.swap_out_blocks += len(batch.swap_out)
        self.swap_in_blocks += len(batch.swap_in)
        if not batch.sequences:
            return
        self.steps += 1
        self.sequences += len(batch.sequences)
        self.running += len(self.engine.scheduler.running)
        covered, decoding, recomputed = self._covered, 0, 0
        for seq in batch.sequences:
            # A drafted decode computes its drafts too; only those accepted become the sample's (not recomputed).
            computed = seq.num_tokens - len(seq.draft)
            rid, start, end = seq.request.request_id, seq.start, seq.start + computed
            self.draft_tokens += len(seq.draft)
            if computed == 1:
                decoding += 1
            high = covered.get(rid, 0)
            if start < high:
                recomputed += min(end, high) - start
            if end > high:
                covered[rid] = end
        self.decoding += decoding
        if decoding == len(batch.sequences) <= self.tail_width:
            self.tail_steps += 1
            self.tail_rows += decoding
            self._open_tail[id(batch)] = batch
            drafted = any(seq.draft for seq in batch.sequences)
            self._period = ("tail_drafted_s" if drafted else "tail_plain_s", started)
            if drafted:
                self.tail_drafted_steps += 1
            else:
                self.tail_plain_steps += 1
        if self.engine.scheduler.num_waiting:
            self.queued_steps += 1
            self.queued_decoding += decoding
        self.recomputed_by_position += recomputed
