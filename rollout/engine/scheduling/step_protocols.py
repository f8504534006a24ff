"""What one step reads of the scheduler and asks of it, and of the drafter and the suspects, as structural types: the
step builder (`step_builder.py`) and a suspect's step (`suspects.py`) import these, not the scheduler, which makes
a `StepBuilder` per step. Never imports torch."""

from __future__ import annotations

from collections import deque
from typing import Protocol

from rollout.engine.requests.request import Request
from rollout.engine.scheduling.admission import AdmissionGate
from rollout.engine.scheduling.batch import ScheduledBatch
from rollout.engine.scheduling.block_manager import BlockManager
from rollout.engine.scheduling.client_turns import ClientTurns


class SchedulerQueues(Protocol):
    """What a step reads of the scheduler and the moves it asks of it (structural: this module does not import the
    scheduler, which makes a `StepBuilder` per step)."""

    waiting: deque[Request]
    swapped: deque[Request]
    running: list[Request]
    block_manager: BlockManager
    admission: AdmissionGate
    max_batch_tokens: int
    max_num_seqs: int
    admitting: bool
    drafter: Drafter | None
    turns: ClientTurns
    suspects: Suspected

    def next_arrival(self) -> int: ...

    def lane_candidates(self) -> list[Request]: ...

    def preempt(self, request: Request, batch: ScheduledBatch) -> None: ...

    def finish(self, request: Request, reason: str, error: str | None = None) -> list[Request]: ...


class Suspected(Protocol):
    """The samples of a failed step, computed only in steps of their own group (`suspects.Suspects`)."""

    requests: dict[int, Request]


class Drafter(Protocol):
    """Proposes draft tokens for decodes (`rollout.engine.speculative.SuffixDrafter`)."""

    def speculates(self, num_decodes: int) -> bool:
        """Whether a step with this many decodes drafts at all (the long tail)."""
        ...

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        """Up to `limit` draft tokens to follow the request's last token (none: decode it plainly)."""
        ...
