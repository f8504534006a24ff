"""`SuffixDrafter`: draft tokens for speculative decoding (`ContinuousBatchingConfig(speculative="suffix")`), with no
draft model: each sample's drafts come from the pool of its prompt (`suffix_pool.DraftPool`): its group's samples,
running or finished, and earlier rounds' samples of the same prompt, from the same client (`Request.client`), the same
session (`Request.session`) and the same adapter.

Only where it pays:
- a step drafts only while its decodes are at most `speculative_disable_by_batch_size` (the long tail, where a thin
  batch leaves the device idle);
- a draft follows a match of the sample's last tokens; how often drafts were accepted is kept per match length
  (2 to 8 and longer tokens), and a match length whose drafts are mostly rejected proposes nothing, except in one
  thin step of every `EXPLORE` (where every match length proposes, to keep the rates current): short matches are
  coincidences at high entropy and good guesses at low entropy, and the rates tell which case the engine is in; a
  thin step where no match length pays, and that does not explore, looks for no match at all (its samples still
  join their pools, and the pools are indexed, as in any thin step: the drafts of later steps are the same);
- with overlapped scheduling, a thin step waits for the step before to reach the host (drafts follow a sample's last
  token) only when it may draft: while some match length pays, or when it explores, and some sample is not pausing;
- a row whose recent drafts were mostly rejected (its rate, each verification weighing half, below 30%: two drafts
  rejected whole in a row do it) stops drafting for 4 steps, so a high-entropy sample costs little verification work;
- drafts are cut before the first token the sample's bans (suppress_tokens, one-token bad words, stop tokens before
  min_new_tokens) or its grammar refuses: the verification would reject it anyway.

Memory: the finished samples' tokens the pools keep are bounded by `speculative_index_tokens`; the pools used least
recently are dropped first. A weight update clears them only with `speculative_clear_on_weight_update` (drafts are
only proposals: the verification draws every token from the current weights).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from rollout.engine.grammar import cpu_bounds
from rollout.engine.requests.bans import always_banned
from rollout.engine.requests.request import Request
from rollout.engine.speculative.suffix_pool import DraftPool

MIN_ACCEPTANCE = 0.3  # a row, or a match length, drafting below this acceptance rate pauses
LONG_MATCH = 8  # matches of this many tokens or more share one acceptance rate
EXPLORE = 16  # one thin step in this many lets every match length propose
RATE_MEMORY = 0.98  # each verification's weight in a match length's rate is 2% (about the last 50 count)
PAUSE = 4  # steps a failing row pauses for
SMOOTHING = 0.5  # weight of the latest verification in a row's acceptance rate


@dataclass(eq=False)
class _Row:
    """A sample's place in its pool and its recent acceptance."""

    key: tuple
    pool: DraftPool
    sequence: int
    banned: frozenset[int]
    acceptance: float = 1.0
    match: int = LONG_MATCH  # the match length its last draft followed
    resume_step: int = 0


@dataclass(eq=False)
class _PoolEntry:
    pool: DraftPool
    finished_tokens: int = 0  # tokens of finished samples the pool keeps
    indexed_step: int = -1  # the step its index was last caught up in


class SuffixDrafter:
    """Proposes draft tokens for thin decoding batches (the scheduler asks; `verify.accept_drafts` reports back)."""

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int, index_tokens: int):
        """
        Args:
            num_speculative_tokens: the most draft tokens per sample and step.
            disable_by_batch_size: steps with more decodes than this draft nothing.
            index_tokens: the most tokens of finished samples kept for drafting, over all prompts.
        """
        self.num_speculative_tokens = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.index_tokens = index_tokens
        self._pools: OrderedDict[tuple, _PoolEntry] = OrderedDict()  # least recently used first
        self._finished_tokens = 0
        self._step = 0
        self.proposed_tokens = 0  # drafts proposed (counters)
        self.accepted_tokens = 0  # drafts accepted
        # Per match length (2 .. LONG_MATCH): decayed (accepted, proposed) draft tokens. They start below
        # MIN_ACCEPTANCE, as if one draft token in four had been accepted, so a match length proposes only once
        # explorations' drafts were accepted: one whole draft of 4 tokens or more, or several shorter ones (each
        # verification weighs 2%). Measured: starting nearer the threshold lets short, poorer matches propose, whose
        # rejections pause rows that longer matches would have served (tail forwards per token 0.461 -> 0.470 on
        # `long-tail --model tiny --entropy 0.1`).
        self._rates = {length: [0.25, 1.0] for length in range(2, LONG_MATCH + 1)}
        self._thin_steps = 0  # steps that could draft (thin, nothing queued)
        self._exploring = False  # this step lets every match length propose
        self._looking = False  # this step looks for drafts: it explores, or some match length pays

    def speculates(self, num_decodes: int) -> bool:
        """Whether a step with `num_decodes` decodes drafts (once per step, from the scheduler)."""
        self._step += 1
        if num_decodes > self.disable_by_batch_size:
            return False
        self._thin_steps += 1
        self._exploring = self._thin_steps % EXPLORE == 0
        # Rates change only when a verification reports (`verified`, as a step resolves), never while one is built.
        self._looking = self._exploring or self._some_length_pays()
        return True

    def wants_tokens(self, running: list[Request]) -> bool:
        """Whether the next thin step may draft: some match length pays, or it explores, and some running sample
        is not pausing then. With overlapped scheduling the step loop then brings the step before's tokens to the
        host first (a draft follows a sample's last token); otherwise the steps stay overlapped: a tail whose every
        sample pauses (high entropy) keeps its host work under the device's.

        Args:
            running: the samples the next step may decode.
        """
        if not ((self._thin_steps + 1) % EXPLORE == 0 or self._some_length_pays()):
            return False
        return not all(self._pausing(request, self._step + 1) for request in running)

    def _pausing(self, request: Request, step: int) -> bool:
        """Whether the request's row proposes nothing at `step` for its pause (a row whose pool was dropped joins
        a fresh one, unpaused, at its next proposal)."""
        row = request.draft_row
        if row is None or step >= row.resume_step:
            return False
        entry = self._pools.get(row.key)
        return entry is not None and entry.pool is row.pool

    def _some_length_pays(self) -> bool:
        return any(accepted >= MIN_ACCEPTANCE * proposed for accepted, proposed in self._rates.values())

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        """Up to `limit` (and `num_speculative_tokens`) draft tokens to follow the request's last token.

        Args:
            request: a decode whose tokens are all on the host.
            limit: the most draft tokens this step can take for it (token budget, max_new_tokens).
        """
        if request.num_output_tokens < 1:
            return ()
        row = self._row(request)
        if self._step < row.resume_step:
            return ()
        entry = self._pools[row.key]
        self._pools.move_to_end(row.key)
        if entry.indexed_step != self._step:  # its samples' tokens of the last step, indexed once for all of them
            entry.pool.catch_up()
            entry.indexed_step = self._step
        if not self._looking:  # every draft would be dropped (`_pays`): the pool and its index kept as ever
            return ()
        draft, match = row.pool.propose(row.sequence, min(limit, self.num_speculative_tokens))
        if not draft or not self._pays(min(match, LONG_MATCH)):
            return ()
        draft = self._cut(request, row, draft)
        if draft:
            row.match = min(match, LONG_MATCH)
        return draft

    def verified(self, request: Request, proposed: int, accepted: int) -> None:
        """Record how many of a request's drafts the verification accepted (a row that keeps failing pauses)."""
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        row = request.draft_row
        if row is None or not proposed:
            return
        rate = self._rates[row.match]
        rate[0] = RATE_MEMORY * rate[0] + (1 - RATE_MEMORY) * accepted
        rate[1] = RATE_MEMORY * rate[1] + (1 - RATE_MEMORY) * proposed
        row.acceptance = (1 - SMOOTHING) * row.acceptance + SMOOTHING * accepted / proposed
        if row.acceptance >= MIN_ACCEPTANCE:
            return
        # Below the threshold it pauses: two drafts rejected whole in a row do it (from a rate of 1 at its start, and
        # of 2 * MIN_ACCEPTANCE after each pause), and so do several accepted in small part. The pause does not grow
        # while it keeps failing: measured, pauses doubling up to 64 steps kept rows from drafts that would have been
        # accepted (tail forwards per token 0.461 -> 0.481 on `long-tail --model tiny --entropy 0.1`) and saved a few
        # rejected drafts at entropy 1.5 (298 -> 282), within noise.
        row.resume_step = self._step + PAUSE
        row.acceptance = 2 * MIN_ACCEPTANCE

    def poisoned(self, request: Request) -> None:
        """A drafted step of this sample turned non-finite: it never drafts again (plain decoding decides)."""
        self._row(request).resume_step = 1 << 62

    def _pays(self, match: int) -> bool:
        """Whether drafts following a match of this length are accepted often enough (or the step explores)."""
        accepted, proposed = self._rates[match]
        return self._exploring or accepted >= MIN_ACCEPTANCE * proposed

    def finished(self, request: Request) -> None:
        """Keep a finished sample's tokens for its prompt's later drafts (within the memory bound). One that
        generated nothing (a score-only request, max_new_tokens=0; a sample cancelled before its first token) has
        nothing to draft from: kept, its prompt would only push other prompts' samples out of the bound."""
        if request.draft_row is None and not request.num_output_tokens:
            return
        row = self._row(request)
        entry = self._pools.get(row.key)
        request.draft_row = None
        if entry is None:
            return
        self._pools.move_to_end(row.key)
        row.pool.finish(row.sequence)
        entry.finished_tokens += len(request.token_ids)
        self._finished_tokens += len(request.token_ids)
        while self._finished_tokens > self.index_tokens and self._pools:
            _, dropped = self._pools.popitem(last=False)
            self._finished_tokens -= dropped.finished_tokens

    def forget(self, prompt_ids: list[int], scope: str = "", adapter: str | None = None) -> None:
        """Drop one prompt's pool (the engine's warm-up request leaves no drafts behind)."""
        entry = self._pools.pop((scope, "", adapter, tuple(prompt_ids)), None)
        if entry is not None:
            self._finished_tokens -= entry.finished_tokens

    def clear(self) -> None:
        """Forget every pool (running samples join fresh ones at their next proposal)."""
        self._pools.clear()
        self._finished_tokens = 0

    @property
    def num_pools(self) -> int:
        """Prompts with a pool."""
        return len(self._pools)

    def _row(self, request: Request) -> _Row:
        """The request's row in its prompt's pool, joining it (again, after the pool was dropped) if need be."""
        row = request.draft_row
        if row is not None:
            entry = self._pools.get(row.key)
            if entry is not None and entry.pool is row.pool:
                return row
        adapter = None if request.adapter is None else request.adapter.name
        key = (request.client, request.session, adapter, tuple(request.prompt_ids))
        entry = self._pools.get(key)
        if entry is None:
            entry = self._pools[key] = _PoolEntry(DraftPool(request.num_prompt_tokens))
        banned = frozenset(always_banned(request))
        row = _Row(key, entry.pool, entry.pool.add(request.token_ids), banned)
        request.draft_row = row
        return row

    def _cut(self, request: Request, row: _Row, draft: tuple[int, ...]) -> tuple[int, ...]:
        """The draft up to the first token the request's bans or grammar refuse at its position."""
        min_new, stops = request.sampling.min_new_tokens, request.stop_token_ids
        first = request.num_output_tokens  # the output index of the draft's first token
        kept = len(draft)
        for offset, token in enumerate(draft):
            if token in row.banned or (token in stops and first + offset < min_new):
                kept = offset
                break
        constraint = request.constraint
        if constraint is not None and kept:
            kept = _grammar_allows(constraint, draft[:kept])
        return draft[:kept]


def _grammar_allows(constraint, draft: tuple[int, ...]) -> int:  # noqa: ANN001 - a grammar.constraints.Constrained
    """How many of the draft's first tokens the sample's grammar accepts in a row (its matcher is left as found).

    The check's accepts are the sample's own accepts done ahead (untimed by its `CpuWatch`), on states further along,
    so it stops once it took MAX_ACCEPT_S of CPU (the draft cut there: a shorter proposal, the same tokens drawn), and
    proposes nothing for a grammar found too slow to follow: its sample ends at its next step, and a check of K drafts
    of such a grammar cost K of its slow accepts on top."""
    if not constraint.is_open or constraint.ahead or constraint.watch.too_slow is not None:
        return 0
    matcher, accepted = constraint.matcher, 0
    deadline = time.thread_time() + cpu_bounds.MAX_ACCEPT_S  # (read here: the bound may be changed at run time)
    for token in draft:
        if not matcher.accept_token(token):
            break
        accepted += 1
        if time.thread_time() > deadline:
            break
    if accepted:
        matcher.rollback(accepted)
    return accepted
