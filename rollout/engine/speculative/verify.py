"""The verification of a drafted step: each drafted sample's next tokens are drawn one position at a time, exactly as
plain decoding would draw them, from the logits the step computed at its last token and at each draft token.

Position j's token is drawn by the ordinary sampler once position j - 1's is resolved, so everything it depends on
is what plain decoding would have seen: the same seed, sample index and position; penalties, bans, min_new_tokens and
logit_bias over the tokens resolved so far; the grammar advanced past them. A draft token counts (its KV, computed in
the step, becomes the sample's) only while it equals the token drawn at its position; the first draw that differs is
kept as the sample's next token and the drafts after it are dropped, with their logits. A stop token, a stop string
or max_new_tokens among the drawn tokens ends the sample there, as without drafts. So a seeded sample gets the same
tokens with and without speculation: bit for bit under `batch_invariant=True`, where the step's logits equal a plain
decode's; otherwise up to the rounding that a multi-token forward changes (a draw at a near-tie may differ).

A sample whose draws read none of its tokens (no penalty, no n-gram or multi-token bad-word ban, no grammar: GRPO's
usual settings; `draws_ahead`) needs no round trip per position: its draw at draft position j is a pure function of
the step's logits row j, its seed and its position, so `sample_drafted` draws every draft position of it in the
step's own sampling pass, they come to the host with the step's tokens, and its rounds only read them (`PendingSamples.
select`). The rounds still run position by position on the host, so everything a token does (ending the sample,
streaming) happens as before; only samples whose draws read their tokens draw on the device round by round.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollout.engine.kv.transfer import to_device
from rollout.engine.requests.request import Request, RequestStatus
from rollout.engine.sampling.ban_lists import has_history
from rollout.engine.sampling.pending_samples import PendingSamples, SamplerOutput
from rollout.engine.sampling.sampler import Sampler
from rollout.engine.sampling.slot_state import penalized
from rollout.engine.scheduling.batch import ScheduledBatch, ScheduledSequence
from rollout.engine.speculative.drafter import SuffixDrafter

# Draws one token for each sample of a one-token-per-sample batch from the given logits rows (in samples order), or
# takes the draws given (drawn ahead, on the host), counts the batch as computed and resolves its tokens; returns the
# requests that progressed (`StepLoop`).
DrawRound = Callable[[ScheduledBatch, "torch.Tensor | SamplerOutput"], list[Request]]


def draws_ahead(request: Request) -> bool:
    """Whether a sample's draws read none of its tokens, so those at its draft positions can be made with its step
    (`sample_drafted`): no penalty, no ban on its recent tokens (no_repeat_ngram_size, multi-token bad words), no grammar.
    Bans by position (begin_suppress_tokens, min_new_tokens' stop tokens) read only the position."""
    return request.constraint is None and not penalized(request) and not has_history(request.sampling)


def sample_drafted(
    sampler: Sampler, logits: torch.Tensor, batch: ScheduledBatch, return_logprobs: bool
) -> tuple[PendingSamples, PendingSamples | None, dict[tuple[int, int], int]]:
    """A drafted step's sampling, queued in one pass (nothing waits for the device): every sample's first draw and,
    for the samples that `draws_ahead`, the draws at each of their draft positions, which their verification rounds
    read instead of drawing.

    Returns (the first draws, in `batch.samples` order; all the pass's draws, or None when no sample draws ahead;
    (id(request), draft position) -> row of those).

    Args:
        sampler: the engine's sampler (its `sample` with `ahead`: each row's position past the request's next).
        logits: the step's logits, all its rows.
        batch: the drafted step.
        return_logprobs: compute log-probs (and top log-probs where asked).
    """
    first_row = {id(request): row for request, row in batch.samples}
    pairs: list[tuple[Request, int]] = []
    offsets: list[int] = []
    for seq in batch.sequences:
        request = seq.request
        if seq.draft and id(request) in first_row and draws_ahead(request):
            for position in range(1, len(seq.draft) + 1):  # logits row first + position: the token past draft[-1]
                pairs.append((request, first_row[id(request)] + position))
                offsets.append(position)
    if not pairs:
        return sampler.sample(logits, batch.samples, return_logprobs), None, {}
    count = len(batch.samples)
    both = sampler.sample(logits, batch.samples + pairs, return_logprobs, ahead=[0] * count + offsets)
    rows = {
        (id(request), position): count + index for index, ((request, _), position) in enumerate(zip(pairs, offsets))
    }
    return both.first_rows(count), both, rows


def accept_drafts(
    batch: ScheduledBatch,
    logits: torch.Tensor,
    draw: DrawRound,
    drafter: SuffixDrafter,
    progressed: list[Request],
    ahead: PendingSamples | None = None,
    ahead_rows: dict[tuple[int, int], int] | None = None,
) -> None:
    """Draw the drafted samples' tokens past the first (already drawn and resolved from their first row), position
    by position, while each draw equals the draft token it follows; tell the drafter what was accepted.

    Args:
        batch: the drafted step, advanced and resolved once (every sample's first token).
        logits: the step's logits, all its rows (`ModelRunner.run`).
        draw: draws and resolves one round (`DrawRound`).
        drafter: told how many of each sample's drafts were accepted.
        progressed: the requests that progressed in each round are appended here as the round resolves (a round
            that raises leaves the earlier rounds' there, for their outputs).
        ahead: the step's draws made ahead (`sample_drafted`); its samples' rounds read them instead of drawing.
        ahead_rows: (id(request), draft position) -> row of `ahead`.
    """
    first_row = {id(request): row for request, row in batch.samples}  # a withdrawn sample has none (`withdraw`)
    drafted = [
        (seq.request, first_row[id(seq.request)], seq.draft)
        for seq in batch.sequences
        if seq.draft and id(seq.request) in first_row
    ]
    accepted = dict.fromkeys((id(request) for request, _, _ in drafted), 0)
    ahead_rows = ahead_rows if ahead is not None and ahead_rows else {}
    live, position = drafted, 0
    while live:
        # Position `position`'s token was drawn and resolved last: its draft token stands if it equals the draw.
        live = [  # a sample ended, or withdrawn to be recomputed (WAITING), draws no further
            (request, row, draft)
            for request, row, draft in live
            if position < len(draft)
            and request.status == RequestStatus.RUNNING
            and request.token_ids[-1] == draft[position]
        ]
        position += 1
        if not live:
            break
        for request, _, _ in live:
            accepted[id(request)] += 1
        known = [entry for entry in live if (id(entry[0]), position) in ahead_rows]
        if known:  # drawn with the step: on the host already
            progressed += draw(_round(known), ahead.select([ahead_rows[id(r), position] for r, _, _ in known]))
        rest = [entry for entry in live if (id(entry[0]), position) not in ahead_rows] if known else live
        if rest:
            rows = to_device([row + position for _, row, _ in rest], torch.long, logits.device)
            progressed += draw(_round(rest), logits.index_select(0, rows))
    for request, _, draft in drafted:
        drafter.verified(request, len(draft), accepted[id(request)])


def _round(live: list[tuple[Request, int, tuple[int, ...]]]) -> ScheduledBatch:
    """One verification round: each live sample's next position, one token and one draw each."""
    round_batch = ScheduledBatch()
    for index, (request, _, _) in enumerate(live):
        round_batch.sequences.append(ScheduledSequence(request, request.num_computed_tokens, 1))
        round_batch.logits_sequences.append(index)
        round_batch.samples.append((request, index))
    return round_batch


def rejected_slots(batch: ScheduledBatch, block_size: int) -> list[int]:
    """The cache slots of a verified step's drafts that were not accepted, in the running samples' own blocks (the
    finished ones' blocks are freed and zeroed before reuse): what the step wrote past each one's computed tokens."""
    slots = []
    for seq in batch.sequences:
        request = seq.request
        if seq.draft and request.status == RequestStatus.RUNNING:
            blocks = request.block_ids
            for position in range(request.num_computed_tokens, seq.start + seq.num_tokens):
                slots.append(blocks[position // block_size] * block_size + position % block_size)
    return slots


def withdraw_poisoned(
    batch: ScheduledBatch, sampled: SamplerOutput, rows: list[int], recompute: Callable[[Request], None]
) -> SamplerOutput:
    """Take drafted samples whose logits turned non-finite out of their verification, to recompute them plainly.

    A draft token may poison a drafted step where plain decoding never goes: its non-finite KV reaches the other
    positions of the step through masked attention (0 x NaN is NaN). So the sample is not ended with an error, as a
    plain decode's non-finite logits end it: its tokens resolved so far stand (drawn from finite logits), and it goes
    back to be recomputed from them without drafts (`recompute`: its KV quarantined, its sampling state rebuilt).

    Args:
        batch: the step (or verification round) the rows belong to; the withdrawn samples leave `batch.samples`.
        sampled: its sampled tokens.
        rows: the indices into `batch.samples` to withdraw.
        recompute: sends one sample back to be recomputed.
    Returns:
        `sampled` without the withdrawn rows (the other rows' indices renumbered).
    """
    withdrawn = set(rows)
    for index in rows:
        recompute(batch.samples[index][0])
    keep = [index for index in range(len(batch.samples)) if index not in withdrawn]
    batch.samples[:] = [batch.samples[index] for index in keep]
    return sampled.select(keep)
