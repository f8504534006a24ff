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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollout.engine.kv.transfer import to_device
from rollout.engine.requests.request import Request
from rollout.engine.scheduling.batch import ScheduledBatch, ScheduledSequence
from rollout.engine.speculative.drafter import SuffixDrafter

# Draws one token for each sample of a one-token-per-sample batch from the given logits rows (in samples order),
# counts the batch as computed and resolves its tokens; returns the requests that progressed (`StepLoop`).
DrawRound = Callable[[ScheduledBatch, torch.Tensor], list[Request]]


def accept_drafts(
    batch: ScheduledBatch, logits: torch.Tensor, draw: DrawRound, drafter: SuffixDrafter
) -> list[Request]:
    """Draw the drafted samples' tokens past the first (already drawn and resolved from their first row), position
    by position, while each draw equals the draft token it follows; tell the drafter what was accepted.

    Args:
        batch: the drafted step, advanced and resolved once (every sample's first token).
        logits: the step's logits, all its rows (`ModelRunner.run`).
        draw: draws and resolves one round (`DrawRound`).
        drafter: told how many of each sample's drafts were accepted.
    Returns:
        The requests that progressed in the rounds, in order (a request once per round it drew in).
    """
    first_row = {id(request): row for request, row in batch.samples}
    drafted = [(seq.request, first_row[id(seq.request)], seq.draft) for seq in batch.sequences if seq.draft]
    accepted = dict.fromkeys((id(request) for request, _, _ in drafted), 0)
    progressed: list[Request] = []
    live, position = drafted, 0
    while live:
        # Position `position`'s token was drawn and resolved last: its draft token stands if it equals the draw.
        live = [
            (request, row, draft)
            for request, row, draft in live
            if position < len(draft) and not request.is_finished and request.token_ids[-1] == draft[position]
        ]
        position += 1
        if not live:
            break
        for request, _, _ in live:
            accepted[id(request)] += 1
        round_batch = ScheduledBatch()
        for index, (request, _, _) in enumerate(live):
            round_batch.sequences.append(ScheduledSequence(request, request.num_computed_tokens, 1))
            round_batch.logits_sequences.append(index)
            round_batch.samples.append((request, index))
        rows = to_device([row + position for _, row, _ in live], torch.long, logits.device)
        progressed += draw(round_batch, logits.index_select(0, rows))
    for request, _, draft in drafted:
        drafter.verified(request, len(draft), accepted[id(request)])
    return progressed
