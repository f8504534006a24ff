"""Admission under memory pressure: how much KV the running requests are expected to grow into, and which running
request a preemption takes. Never imports torch (the scheduler's own rules).

A request's length is unknown until it stops, so a cache far smaller than the work (long reasoning rollouts) fills
with requests that all keep growing. Admitting only on the blocks a prompt needs now over-admits, and the scheduler
then preempts the newest request, readmits it as soon as its blocks are back, and preempts it again (thrashing: the
same samples recomputed many times). Two rules stop that:

- Growth reserve: a request (new, preempted or swapped out) is admitted only while the free blocks also cover the
  expected growth of every running request and of itself: min(max_new_tokens - generated, clip_tokens) x `ratio`
  tokens each, a group leader counted once per sample it will fork. `ratio` adapts (as SGLang's new_token_ratio):
  every step it decays towards its floor, over as many steps as the mean length of the requests finished so far, and
  a preemption raises it back to at least `initial_ratio` (doubling it, up to 1), so admission turns careful exactly
  when the cache ran short and bold again as requests turn over.
- Victim: the running request with the fewest generated tokens (the newest among ties) is preempted, not simply the
  newest arrival: what it loses (its tokens not held by the prefix cache) is the least, and a readmitted request,
  which keeps its output, is not taken again before fresher ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rollout.engine.block_manager import cdiv
from rollout.engine.request import Request


@dataclass
class GrowthReserve:
    """Expected KV growth of requests, in blocks, with the adaptive ratio described in the module docstring.

    Attributes:
        block_size: tokens per KV block.
        clip_tokens: most tokens one request is expected to grow by (its max_new_tokens may be far larger).
        initial_ratio: the ratio at start and the least it is raised to by a preemption.
        floor_ratio: the ratio decays no lower.
    """

    block_size: int
    clip_tokens: int = 4096
    initial_ratio: float = 0.5
    floor_ratio: float = 0.05
    ratio: float = field(init=False)
    num_finished: int = field(init=False, default=0)
    finished_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.ratio = self.initial_ratio

    @property
    def mean_length(self) -> int:
        """The mean generated length of the requests that finished so far (clip_tokens before any did), at least
        one block: the steps the ratio takes to decay from initial_ratio to floor_ratio, so that it settles as
        fast as requests turn over (a step decodes one token of each running request)."""
        if not self.num_finished:
            return self.clip_tokens
        return max(self.block_size, self.finished_tokens // self.num_finished)

    def finished(self, num_generated: int) -> None:
        """A request ended with `num_generated` tokens (a stop or its length)."""
        self.num_finished += 1
        self.finished_tokens += num_generated

    def step(self) -> None:
        """One scheduling step passed without trouble: expect a little less growth."""
        step = (self.initial_ratio - self.floor_ratio) / self.mean_length
        self.ratio = max(self.floor_ratio, self.ratio - step)

    def preempted(self) -> None:
        """The cache ran short: expect more growth from now on."""
        self.ratio = min(1.0, max(self.initial_ratio, 2 * self.ratio))

    def blocks(self, request: Request) -> int:
        """Blocks `request` (and the samples it will fork) is expected to grow into from here."""
        remaining = request.max_new_tokens - (len(request.token_ids) - request.num_prompt_tokens)
        tokens = min(max(remaining, 0), self.clip_tokens) * self.ratio
        return (1 + request.num_forks) * cdiv(int(tokens), self.block_size)

    def total(self, requests: Iterable[Request]) -> int:
        """Blocks all of `requests` are expected to grow into."""
        return sum(self.blocks(request) for request in requests)


def cheapest_victim(
    running: list[Request], scheduled: set[int], ref_counts: list[int], block_size: int
) -> Request | None:
    """The preemption victim: among running requests this step neither computes nor samples (`scheduled` holds the
    ids of those it does), the one whose preemption loses the fewest computed tokens: its computed tokens beyond its
    leading blocks shared with another request (a GRPO group's prompt, which stays in the cache), then the fewest
    generated tokens, then the newest arrival.

    Args:
        running: the running requests.
        scheduled: ids of the requests this step computes or samples.
        ref_counts: the block manager's ref count per device block.
        block_size: tokens per block.
    """
    best, best_key = None, None
    for request in running:
        if id(request) in scheduled:
            continue
        shared = 0
        for block in request.block_ids:
            if ref_counts[block] <= 1:
                break
            shared += 1
        key = (
            request.num_computed_tokens - shared * block_size,
            len(request.token_ids) - request.num_prompt_tokens,
            -request.arrival,
        )
        if best_key is None or key < best_key:
            best, best_key = request, key
    return best
