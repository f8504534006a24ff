"""Admission with known lengths: the most KV blocks the running requests will hold at once when each runs to its
max_new_tokens (`rollout.engine.scheduling.admission` uses it while finished requests show max_new_tokens to be their
lengths). Never imports torch.

The demand is highest just before a request ends, so it is evaluated at each request's end, latest first, in one
sweep over the requests sorted by their ends. t tokens from now:
- a decoding sequence has taken at most cdiv(t, block_size) more blocks (one more for a fork whose first write copies
  the partial block it shares with its leader);
- a request still computing its prompt (or recomputing its output) takes its whole growth, the blocks of its prompt's
  later chunks included, at once; since it may compute as little as one token a step, its end is put that many steps
  later;
- an ended request has given back the blocks it held alone. A candidate that reuses some of those blocks through the
  prefix cache keeps them held: they stay reserved (`FuturePeak.admits`).
The blocks a request holds alone are not always its trailing ones (a prefix chained through blocks of two holders, a
prompt ending on a block boundary computing its own copy of its last block): the block manager keeps their count on
each request (`Request.num_own_blocks`, `block_holders`), so a step's peak costs O(running requests).

Each running request is assumed to compute at least one token a step: `AdmissionGate` keeps the running sequences
within the token budget while lengths are known.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

from rollout.engine.requests.request import Request
from rollout.engine.scheduling.block_manager import BlockManager, cdiv


class Lifetime(NamedTuple):
    """What the sweep needs of one request (sorted by `end`)."""

    end: int  # tokens (steps) from now until it ends
    growing: int  # sequences that take a block every block_size tokens until `end` (0 while it computes a prompt)
    own: int  # blocks it holds alone now: they come back when it ends
    extra: int  # blocks it takes beyond that growth: copies of shared partial blocks, uncomputed chunks


def lifetime(request: Request, ref_counts: list[int], block_size: int) -> Lifetime:
    """A running request's `Lifetime`: its own blocks, and what it grows into until its max_new_tokens.

    Args:
        request: a running request.
        ref_counts: the block manager's ref count per device block.
        block_size: tokens per block.
    """
    num_tokens, blocks = len(request.token_ids), request.block_ids
    left = max(0, request.max_new_tokens - (num_tokens - request.num_prompt_tokens))
    sequences = 1 + request.num_forks
    own = request.num_own_blocks  # held alone, kept up to date by the block manager
    extra = sequences - 1  # each fork to come copies the partial block it shares
    computed = request.num_computed_tokens
    if (
        computed % block_size
        and computed // block_size < len(blocks)
        and ref_counts[blocks[computed // block_size]] > 1
    ):
        extra += 1  # a fork whose next write copies the partial block it shares
    uncomputed = max(0, num_tokens - 1 - computed)  # 0 once it decodes
    if not uncomputed:
        return Lifetime(left, sequences, own, extra)
    extra += max(0, cdiv(num_tokens - 1, block_size) - len(blocks)) + sequences * cdiv(left, block_size)
    return Lifetime(left + uncomputed, 0, own, extra)


def candidate_lifetime(request: Request, chunk_end: int, block_size: int) -> Lifetime:
    """The `Lifetime` of a request being admitted with its tokens computed up to `chunk_end` this step.

    Args:
        request: the candidate (new, preempted or swapped out); it holds no blocks of its own yet.
        chunk_end: where its computed tokens end after this step.
        block_size: tokens per block.
    """
    left = max(0, request.max_new_tokens - request.num_output_tokens)
    sequences = 1 + request.num_forks
    uncomputed = max(0, request.num_tokens - chunk_end)
    if not uncomputed:
        return Lifetime(left, sequences, 0, sequences - 1)
    pending = cdiv(request.num_tokens, block_size) - cdiv(chunk_end, block_size)
    return Lifetime(left + uncomputed, 0, 0, sequences - 1 + pending + sequences * cdiv(left, block_size))


def sweep(ascending: list[Lifetime], block_size: int) -> int:
    """The most blocks, beyond those held now, that requests will hold at once (the module docstring's model).

    Args:
        ascending: the requests' lifetimes, sorted by `end`.
        block_size: tokens per block.
    """
    freed_by_ended = sum(life.own for life in ascending)
    peak = growing = extra = 0
    for end, sequences, own, more in reversed(ascending):  # `end` tokens from now, requests ending sooner are gone
        growing += sequences
        extra += more
        freed_by_ended -= own
        peak = max(peak, growing * cdiv(end, block_size) + extra - freed_by_ended)
    return peak


def peak_growth(lifetimes: list[Lifetime], block_size: int) -> int:
    """`sweep` over lifetimes in any order.

    Args:
        lifetimes: a `Lifetime` per request.
        block_size: tokens per block.
    """
    return sweep(sorted(lifetimes), block_size)


class FuturePeak:
    """One step's admission with known lengths: the running requests' lifetimes, and those admitted since."""

    def __init__(self, manager: BlockManager, running: list[Request]):
        """
        Args:
            manager: the block manager (its ref counts, as the step starts).
            running: the running requests.
        """
        self.manager = manager
        self.lifetimes = sorted(lifetime(r, manager.ref_counts, manager.block_size) for r in running)
        self.pinned = 0  # blocks running requests hold alone that this step's admissions reuse (never freed)

    def reserve(self) -> int:
        """The blocks to keep free for the requests counted so far: their future peak, and the blocks admissions
        reused from running requests."""
        return sweep(self.lifetimes, self.manager.block_size) + self.pinned

    def admits(self, request: Request, blocks: int, chunk_end: int, prefix_blocks: list[int], least: int) -> bool:
        """True when the free blocks cover `blocks` and, beyond them, the future peak with `request` admitted (at
        least `least`); then it counts for the rest of the step.

        Args:
            request: the candidate.
            blocks: the blocks its admission takes now.
            chunk_end: where its computed tokens end after this step.
            prefix_blocks: the blocks it takes from the prefix cache.
            least: the fewest blocks to keep free beyond `blocks`.
        """
        manager, ref_counts = self.manager, self.manager.ref_counts
        pinned = sum(ref_counts[block] == 1 for block in prefix_blocks)  # a running request's own: now shared
        life = candidate_lifetime(request, chunk_end, manager.block_size)
        index = bisect.bisect(self.lifetimes, life)
        self.lifetimes.insert(index, life)
        if manager.can_allocate(blocks + max(least, self.reserve() + pinned)):
            self.pinned += pinned
            return True
        del self.lifetimes[index]
        return False
