"""What one engine step computes, as the scheduler decided it (no torch): which sequences, how many new tokens each,
which of them get a token sampled, and the KV block moves (swap-out, zeroing, swap-in, copy-on-write) to run
first. A decode with draft tokens (speculative decoding, `rollout.engine.speculative`) computes its last token and
the drafts after it, and gets a logits row for each of them."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.engine.requests.request import Request


@dataclass(slots=True)
class ScheduledSequence:
    """One request's share of a step: tokens [start, start + num_tokens) are computed."""

    request: Request
    start: int
    num_tokens: int
    # Draft tokens fed after the request's last token (they are the last len(draft) of the num_tokens computed):
    # proposals, not the request's tokens, until the verification accepts them.
    draft: tuple[int, ...] = ()


@dataclass
class ScheduledBatch:
    """Everything the model runner and sampler need for one step; plain data, no tensors."""

    sequences: list[ScheduledSequence] = field(default_factory=list)
    # Indices into `sequences` whose last position gets logits, in logits-row order; a sequence with a draft gets
    # 1 + len(draft) consecutive rows (its last token's, then each draft token's).
    logits_sequences: list[int] = field(default_factory=list)
    # (request that receives a token, logits row to sample from). Forked group samples share their leader's row; a
    # drafted sequence's request samples from its first row (the verification samples the others).
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
    # Draft tokens in `sequences` (each has a logits row past its sequence's first).
    num_draft_tokens: int = 0

    @property
    def next_row(self) -> int:
        """The logits row the next sequence that reaches its end gets."""
        return len(self.logits_sequences) + self.num_draft_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(seq.num_tokens for seq in self.sequences)

    @property
    def is_empty(self) -> bool:
        """True when nothing is computed in this step."""
        return not self.sequences
