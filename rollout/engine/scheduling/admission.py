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
  sends each sample's length, or truncation is the rule; requests allowed a single token do not count),
  max_new_tokens is taken as each request's length and the reserve is the future peak instead (`future_peak`): the
  most blocks the requests will hold at once, each growing to its max_new_tokens and freeing its own blocks when it
  ends. A request is then admitted only where the running ones, each computing a token a step (no more sequences
  run than the token budget holds), would not have to be preempted for it; the peak credits the blocks earlier
  finishers free, where a sum of every request's remaining growth assumes they all end together (and keeps the
  running batch small). The window is the last 64 (all of them before 64 finished: one capped request is enough),
  so a worker whose requests change from capped to stopping early under-admits until more than half of the last 64
  stopped early.
- Victim: the running request with the fewest generated tokens (the newest among ties) is preempted, not simply the
  newest arrival: what it loses (its tokens not held by the prefix cache) is the least, and a readmitted request,
  which keeps its output, is not taken again before fresher ones. The express lane's samples are taken last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from rollout.engine.requests.request import Request
from rollout.engine.scheduling.block_manager import BlockManager, cdiv
from rollout.engine.scheduling.express_lane import ExpressLane, life_blocks
from rollout.engine.scheduling.future_peak import FuturePeak


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
        """A request ended with `num_generated` tokens (a stop, or all of its `max_new_tokens`). One allowed a single
        token (a probe, a scoring request) grows no KV and says nothing about lengths: it does not count for
        `lengths_known`. When lengths stop being known, the ratio (not used meanwhile)
        starts again from at least `initial_ratio`."""
        self.num_finished += 1
        self.finished_tokens += num_generated
        if max_new_tokens <= 1:
            return
        known = self.lengths_known
        self.recent_at_length.append(num_generated >= max_new_tokens)
        if known and not self.lengths_known:
            self.ratio = max(self.ratio, self.initial_ratio)

    @property
    def lengths_known(self) -> bool:
        """True while at least half of the last `recent_window` requests to finish (those allowed more than one
        token) used all of their max_new_tokens: it is then taken as each request's length (`future_peak`)."""
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


class AdmissionGate:
    """The scheduler's admission rules, with what they sum over the running requests kept for one step."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_batch_tokens: int):
        """
        Args:
            block_manager: the KV block pool admissions allocate from.
            max_num_seqs: most sequences a step computes: no more are admitted to run (a running request beyond it
                would hold KV without computing).
            max_batch_tokens: the token budget of a step: while lengths are known, no more sequences run than it
                holds, so that each computes at least a token a step (as the future peak assumes).
        """
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.growth = GrowthReserve(block_manager.block_size)
        self.express = ExpressLane(block_manager.num_blocks, block_manager.block_size, max_num_seqs)
        self._step_growth: int | None = None  # the running requests' expected growth, summed once a step
        self._prefilling: list[Request] | None = None  # running requests with more than a decode left to compute
        self._step_sequences: int | None = None  # sequences of the running requests, their unforked samples included
        self._future_peak: FuturePeak | None = None  # the running requests' lifetimes (known lengths)
        self._express_room: int | None = None  # the express lane's blocks left this step
        self._express_seats: int | None = None  # the express lane's sequence slots left this step

    def new_step(self) -> None:
        """Forget the per-step sums (the running set changed) and let the growth ratio decay."""
        self.growth.step()
        self._step_growth = self._prefilling = self._step_sequences = self._future_peak = None
        self._express_room = self._express_seats = None

    def admits(
        self, request: Request, blocks: int, running: list[Request], chunk_end: int, prefix_blocks: list[int]
    ) -> bool:
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
            chunk_end: where its computed tokens end after this step (its later chunks come after).
            prefix_blocks: the blocks it takes from the prefix cache.
        """
        manager = self.block_manager
        if not manager.can_allocate(blocks):
            return False
        if not running:
            return True
        if not self._has_room(request, running):
            return False
        known = self.growth.lengths_known
        least = max(1, manager.num_blocks // 100)
        if known:
            if self._future_peak is None:
                self._future_peak = FuturePeak(manager, running)
            if not self._future_peak.admits(request, blocks, chunk_end, prefix_blocks, least):
                return False
        else:
            if self._step_growth is None:
                self._step_growth = self.growth.total(running)
            own = self.growth.blocks(request)
            if not manager.can_allocate(blocks + max(least, self._step_growth + own)):
                return False
            self._step_growth += own
        self._step_sequences += 1 + request.num_forks
        return True

    def finished(self, request: Request) -> None:
        """A sample ended: its length teaches the growth reserve, unless the express lane admitted it (a short
        request's length says nothing of the requests the reserve holds back, and would make it bold at once).

        Args:
            request: the sample that ended.
        """
        if not request.express_blocks:
            self.growth.finished(request.num_output_tokens, request.max_new_tokens)

    def express_room(self, running: list[Request]) -> int:
        """The blocks the express lane (`express_lane.py`) has room for now (0 while no sequence slot is free, in
        the running set or among the lane's own, since a request admitted through it still needs one). Summed at most
        once a step.

        Args:
            running: the running requests.
        """
        if self._express_room is None:
            self._express_room = self.express.capacity - self.express.used(running)
            self._express_seats = self.express.seats - self.express.sequences(running)
        if self._step_sequences is None:
            self._step_sequences = sum(1 + r.num_forks for r in running)
        seated = self._step_sequences < self.max_num_seqs or self._express_seats > 0
        return self._express_room if seated else 0

    def admits_express(self, request: Request, reserve: int, running: list[Request]) -> bool:
        """True when `request` may be admitted through the express lane: the lane has room for its life's blocks,
        those blocks (with `reserve`) are free now, and a sequence slot is free for each of its samples, in the
        running set or among the lane's own. Counts it in the lane and among the step's sequences.

        Args:
            request: the candidate, which `admits` refused or which waits behind a request it refused.
            reserve: blocks kept free for the running requests' next step ("prefill_first").
            running: the running requests.
        """
        life = life_blocks(request, self.block_manager.block_size)
        if not self.express.eligible(request) or life > self.express_room(running):
            return False
        if not self.block_manager.can_allocate(life + reserve):
            return False
        sequences = 1 + request.num_forks
        if running and not self._has_room(request, running) and sequences > self._express_seats:
            return False
        self.express.took(request)
        self._express_room -= life
        self._express_seats -= sequences
        self._step_sequences += sequences
        return True

    def _has_room(self, request: Request, running: list[Request]) -> bool:
        """Whether the running sequences leave room for `request`'s (module docstring; a group larger than the cap
        goes in while any room is left)."""
        if self._step_sequences is None:
            self._step_sequences = sum(1 + r.num_forks for r in running)
        known = self.growth.lengths_known
        most = min(self.max_num_seqs, self.max_batch_tokens) if known else self.max_num_seqs
        sequences, room = 1 + request.num_forks, most - self._step_sequences
        return not (room <= 0 or room < sequences <= most)

    def known_growth(self, running: list[Request]) -> int:
        """The blocks the running requests are known to grow into (with known lengths; 0 otherwise): a draft may
        take blocks ahead of its need only beyond them, since a sample whose drafts are accepted grows faster than
        the future peak's one token a step.

        Args:
            running: the running requests.
        """
        if not self.growth.lengths_known:
            return 0
        if self._future_peak is None:
            self._future_peak = FuturePeak(self.block_manager, running)
        return self._future_peak.reserve()

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


def leading_shared_blocks(request: Request, ref_counts: list[int]) -> int:
    """How many of a request's blocks, from its first one on, another request holds too (a cached prefix, a
    group's prompt, a fork's leader).

    Args:
        request: a request holding blocks.
        ref_counts: the block manager's ref count per device block.
    """
    shared = 0
    for block in request.block_ids:
        if ref_counts[block] <= 1:
            break
        shared += 1
    return shared


def cheapest_victim(
    running: list[Request], scheduled: set[int], ref_counts: list[int], block_size: int
) -> Request | None:
    """The preemption victim: among running requests this step neither computes nor samples (`scheduled` holds the
    ids of those it does), the one whose preemption loses the fewest computed tokens: its computed tokens beyond its
    leading blocks shared with another request (a GRPO group's prompt, which stays in the cache), then the fewest
    generated tokens, then the newest arrival. A request that holds no block alone frees nothing: it comes late. The
    express lane's samples come last of all: a lane sample preempted comes back through the queue, not the lane
    (`ExpressLane.eligible`), behind every request it passed, and would wait for them all (a short request's few
    tokens lose the least, so it would be picked first); the lane's share is small, so sparing it costs little.

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
        frees_nothing = not request.num_own_blocks  # every block it holds, another holds too
        generated = len(request.token_ids) - request.num_prompt_tokens
        key = (request.express_blocks > 0, frees_nothing, lost, generated, -request.arrival)
        if best_key is None or key < best_key:
            best, best_key = request, key
    return best
