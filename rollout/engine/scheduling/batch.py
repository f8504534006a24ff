"""What one engine step computes, as the scheduler decided it (no torch): which sequences, how many new tokens each,
which of them get a token sampled, and the KV block moves (swap-out, zeroing, swap-in, copy-on-write) to run
first."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.engine.requests.request import Request


@dataclass(slots=True)
class ScheduledSequence:
    """One request's share of a step: tokens [start, start + num_tokens) are computed."""

    request: Request
    start: int
    num_tokens: int


@dataclass
class ScheduledBatch:
    """Everything the model runner and sampler need for one step; plain data, no tensors."""

    sequences: list[ScheduledSequence] = field(default_factory=list)
    # Indices into `sequences` whose last position gets logits, in logits-row order.
    logits_sequences: list[int] = field(default_factory=list)
    # (request that receives a token, logits row to sample from). Forked group samples share their leader's row.
    samples: list[tuple[Request, int]] = field(default_factory=list)
    # Block copies to execute before the forward, in this order: swap-outs, swap-ins, copy-on-write.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Freed blocks that held a failed sample's non-finite KV: zeroed after the swap-outs, before the swap-ins.
    zero_blocks: list[int] = field(default_factory=list)
    # Requests that ended while scheduling (they can never fit); they need no compute.
    finished: list[Request] = field(default_factory=list)
    # Requests preempted while scheduling; after a preemption nothing more is admitted in the step (no ping-pong).
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(seq.num_tokens for seq in self.sequences)

    @property
    def is_empty(self) -> bool:
        """True when nothing is computed in this step."""
        return not self.sequences
