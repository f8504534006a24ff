"""Admission under memory pressure: how much KV the running requests are expected to grow into, and which running
request a preemption takes. Never imports torch (the scheduler's own rules).

A request's length is unknown until it stops, so a cache far smaller than the work (long reasoning rollouts) fills
with requests that all keep growing. Admitting only on the blocks a prompt needs now over-admits, and the scheduler
then preempts the newest request, readmits it as soon as its blocks are back, and preempts it again (thrashing: the
same samples recomputed many times). These rules stop that:

- Growth reserve: a request (new, preempted or swapped out) is admitted only while the free blocks also cover the
  expected growth of every running request and of itself: min(max_new_tokens - generated, clip_tokens) x `ratio`
  tokens each, a group leader counted once per sample it will fork. `ratio` adapts (as SGLang's new_token_ratio):
  every step it decays towards its floor, over as many steps as the mean length of the requests finished so far, and
  a preemption raises it back to at least `initial_ratio` (doubling it, up to 1), so admission turns careful exactly
  when the cache ran short and bold again as requests turn over.
- Known lengths: while at least half of the last 64 requests to finish used all of their max_new_tokens (the trainer
  sends each sample's length, or truncation is the rule), max_new_tokens is taken as each request's length and the
  reserve is the exact future peak instead (`peak_growth`): the most blocks the requests will hold at once, each
  growing to its max_new_tokens and freeing its own blocks when it ends, evaluated just before each one ends. That
  admits as many as run without a preemption: the peak credits the blocks earlier finishers free, where a sum of
  every request's remaining growth assumes they all end together (and keeps the running batch small).
- Victim: the running request with the fewest generated tokens (the newest among ties) is preempted, not simply the
  newest arrival: what it loses (its tokens not held by the prefix cache) is the least, and a readmitted request,
  which keeps its output, is not taken again before fresher ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from rollout.engine.requests.request import Request
from rollout.engine.scheduling.block_manager import BlockManager, cdiv


@dataclass
class GrowthReserve:
    """Expected KV growth of requests, in blocks, with the adaptive ratio described in the module docstring.

    Attributes:
        block_size: tokens per KV block.
        clip_tokens: most tokens one request is expected to grow by (its max_new_tokens may be far larger).
        initial_ratio: the ratio at start and the least it is raised to by a preemption.
        floor_ratio: the ratio decays no lower.
        recent_window: how many of the last requests to finish decide whether lengths are known.
    """

    block_size: int
    clip_tokens: int = 4096
    initial_ratio: float = 0.5
    floor_ratio: float = 0.05
    ratio: float = field(init=False)
    num_finished: int = field(init=False, default=0)
    finished_tokens: int = field(init=False, default=0)
    recent_window: int = 64
    recent_at_length: deque[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.ratio = self.initial_ratio
        self.recent_at_length = deque(maxlen=self.recent_window)

    @property
    def mean_length(self) -> int:
        """The mean generated length of the requests that finished so far (clip_tokens before any did), at least
        one block: the steps the ratio takes to decay from initial_ratio to floor_ratio, so that it settles as
        fast as requests turn over (a step decodes one token of each running request)."""
        if not self.num_finished:
            return self.clip_tokens
        return max(self.block_size, self.finished_tokens // self.num_finished)

    def finished(self, num_generated: int, max_new_tokens: int) -> None:
        """A request ended with `num_generated` tokens (a stop, or all of its `max_new_tokens`)."""
        self.num_finished += 1
        self.finished_tokens += num_generated
        self.recent_at_length.append(num_generated >= max_new_tokens)

    @property
    def lengths_known(self) -> bool:
        """True while at least half of the last `recent_window` requests to finish used all of their max_new_tokens:
        it is then taken as each request's length (`peak_growth`)."""
        recent = self.recent_at_length
        return bool(recent) and 2 * sum(recent) >= len(recent)

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


def leading_shared_blocks(request: Request, ref_counts: list[int]) -> int:
    """How many of a request's blocks another request holds too: blocks are shared (a cached prefix, a group's
    prompt, a fork's leader) only from its first block on, so the count stops at the first block it holds alone.

    Args:
        request: a running request.
        ref_counts: the block manager's ref count per device block.
    """
    shared = 0
    for block in request.block_ids:
        if ref_counts[block] <= 1:
            break
        shared += 1
    return shared


Lifetime = tuple[int, int, int, int]  # `lifetime`: (tokens left, sequences, blocks held alone, blocks pending)


def lifetime(request: Request, ref_counts: list[int], block_size: int) -> Lifetime:
    """What `peak_growth` needs of a running request: the tokens it may still generate, its sequences (a group
    leader that has not forked yet counts once per sample), the blocks it holds alone now, which it frees when it
    ends (its leading blocks shared with its group stay; the last of the group holds them alone), and the blocks its
    prompt's uncomputed chunks will take.

    Args:
        request: a running request.
        ref_counts: the block manager's ref count per device block.
        block_size: tokens per block.
    """
    num_tokens = len(request.token_ids)
    own = len(request.block_ids) - leading_shared_blocks(request, ref_counts)
    pending = max(0, cdiv(num_tokens - 1, block_size) - len(request.block_ids))  # 0 once it decodes
    left = max(0, request.max_new_tokens - (num_tokens - request.num_prompt_tokens))
    return left, 1 + request.num_forks, own, pending


def peak_growth(lifetimes: list[Lifetime], block_size: int) -> int:
    """Most blocks, beyond those they hold now, that requests will hold at once if each generates until its
    max_new_tokens and then frees its own blocks: the demand is highest just before one of them ends, so it is
    evaluated at each one's end, longest first, in O(n log n). t tokens from now, each running request has taken
    its pending blocks and each of its sequences at most cdiv(t, block_size) more (a fork one more: it copies its
    leader's partial last block), and each ended one has given back the blocks it held alone.

    Args:
        lifetimes: a `lifetime` per request.
        block_size: tokens per block.
    """
    ordered = sorted(lifetimes, reverse=True)
    freed_by_ended = sum(life[2] for life in ordered)
    peak = active_sequences = active_extra = 0
    for left, sequences, own, pending in ordered:  # at `left` tokens from now, requests with fewer to go have ended
        active_sequences += sequences
        active_extra += sequences - 1 + pending
        freed_by_ended -= own
        peak = max(peak, active_sequences * cdiv(left, block_size) + active_extra - freed_by_ended)
    return peak


class AdmissionGate:
    """The scheduler's admission rules, with what they sum over the running requests kept for one step."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int):
        """
        Args:
            block_manager: the KV block pool admissions allocate from.
            max_num_seqs: most sequences a step computes: no more are admitted to run (a running request beyond it
                would hold KV without computing).
        """
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.growth = GrowthReserve(block_manager.block_size)
        self._step_growth: int | None = None  # the running requests' expected growth, summed once a step
        self._prefilling: list[Request] | None = None  # running requests with more than a decode left to compute
        self._step_sequences: int | None = None  # sequences of the running requests, their unforked samples included
        self._step_lifetimes: list[Lifetime] | None = None  # the running requests' `lifetime`s (known lengths)

    def new_step(self) -> None:
        """Forget the per-step sums (the running set changed) and let the growth ratio decay."""
        self.growth.step()
        self._step_growth = self._prefilling = self._step_sequences = self._step_lifetimes = None

    def admits(self, request: Request, blocks: int, running: list[Request]) -> bool:
        """True when `request` may take `blocks` blocks now and still leave its own and the running requests'
        expected growth free (at least 1% of the cache; nothing while none runs, so an empty cache always admits),
        and the running requests with their samples (a leader still computing its prompt counts once per sample it
        will fork) stay within max_num_seqs. A group larger than max_num_seqs goes in while any room is left (it
        overshoots for a while), so it does not wait for an empty running set.
        An admitted request's growth counts for the rest of the step. The O(running) sum is made at most once a
        step, and only when the blocks themselves are free.

        Args:
            request: the candidate (new, preempted or swapped out).
            blocks: the blocks its admission takes now.
            running: the running requests.
        """
        manager = self.block_manager
        if not manager.can_allocate(blocks):
            return False
        if not running:
            return True
        if self._step_sequences is None:
            self._step_sequences = sum(1 + r.num_forks for r in running)
        sequences, room = 1 + request.num_forks, self.max_num_seqs - self._step_sequences
        if room <= 0 or room < sequences <= self.max_num_seqs:
            return False
        least = max(1, manager.num_blocks // 100)
        if self.growth.lengths_known:
            if self._step_lifetimes is None:
                self._step_lifetimes = [lifetime(r, manager.ref_counts, manager.block_size) for r in running]
            # it holds none yet (it takes `blocks` now); its prompt's later chunks count once it runs
            own_life = (*lifetime(request, manager.ref_counts, manager.block_size)[:2], 0, 0)
            if not manager.can_allocate(
                blocks + max(least, peak_growth([*self._step_lifetimes, own_life], manager.block_size))
            ):
                return False
            self._step_lifetimes.append(own_life)
        else:
            if self._step_growth is None:
                self._step_growth = self.growth.total(running)
            own = self.growth.blocks(request)
            if not manager.can_allocate(blocks + max(least, self._step_growth + own)):
                return False
            self._step_growth += own
        self._step_sequences += sequences
        return True

    def waits_for_shared_prefill(self, request: Request, num_cached_blocks: int, running: list[Request]) -> bool:
        """True when a running request is computing, and has not yet offered to the prefix cache, the first block
        `request` would compute (same tokens before it, same weights): `request` waits a step or two and finds it
        cached, instead of computing it a second time. This is what keeps a GRPO group's prompt computed once when
        its samples arrive as separate requests, or come back together after a preemption.

        Args:
            request: a waiting request just matched against the prefix cache (its block hashes are memoised).
            num_cached_blocks: how many of its leading blocks the prefix cache holds.
            running: the running requests.
        """
        memo = request.prefix_hash_memo
        if memo is None or num_cached_blocks >= len(memo[1]):
            return False  # prefix caching off, or no full block left to share
        version, block_hash = memo[0], memo[1][num_cached_blocks]
        if self._prefilling is None:
            self._prefilling = [r for r in running if r.num_computed_tokens < len(r.token_ids) - 1]
        end = (num_cached_blocks + 1) * self.block_manager.block_size
        for other in self._prefilling:
            other_memo = other.prefix_hash_memo
            if (
                other.num_computed_tokens < end
                and other_memo is not None
                and other_memo[0] == version
                and len(other_memo[1]) > num_cached_blocks
                and other_memo[1][num_cached_blocks] == block_hash  # chained: the same tokens up to there
            ):
                return True
        return False

    def admitted(self, request: Request) -> None:
        """Count a request admitted by recompute among this step's prefilling requests."""
        if self._prefilling is not None:
            self._prefilling.append(request)


def cheapest_victim(
    running: list[Request], scheduled: set[int], ref_counts: list[int], block_size: int
) -> Request | None:
    """The preemption victim: among running requests this step neither computes nor samples (`scheduled` holds the
    ids of those it does), the one whose preemption loses the fewest computed tokens: its computed tokens beyond its
    leading blocks shared with another request (a GRPO group's prompt, which stays in the cache), then the fewest
    generated tokens, then the newest arrival. A request whose blocks are all shared frees nothing: it comes last.

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
        shared = leading_shared_blocks(request, ref_counts)
        lost = request.num_computed_tokens - shared * block_size
        frees_nothing = shared == len(request.block_ids)
        key = (frees_nothing, lost, len(request.token_ids) - request.num_prompt_tokens, -request.arrival)
        if best_key is None or key < best_key:
            best, best_key = request, key
    return best
