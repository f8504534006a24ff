"""The log-probs of a step's drawn tokens (`Sampler`, last in its pass): each row's chosen log-prob and its top
entries, from the distribution its `logprob_mode` names (see the `Sampler` docstring), computed from the candidates
a step drew from where every row's log-probs are theirs, else from whole rows.

Top entries (`top_entries`, prompt log-probs' too) come in one order whatever else is computed with them.
`torch.topk` orders equal values as its kernel happens to (differently for another k, another number of rows, another
device), and a bf16 model's logits tie often, as do the -inf entries of a truncated distribution. So the entries of a
row that asked for n of them would depend on the widest request of its step. Here each score is made into a unique
int64 key, its float's bits turned into an order-preserving integer and the token id below them (lower ids first
among equal scores), and the keys' topk is one well-defined list: its first n entries are the row's n most likely,
by score, then by token id, whatever the width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.engine.sampling.slot_columns import SlotColumns
from rollout.engine.sampling.slots import SamplingSlots
from rollout.invariant.reductions import invariant_log_softmax

_LOW_BITS = 0x7FFFFFFF


def top_entries(scores: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest entries of each row of `scores`, ties taken in increasing column order: (values, columns),
    both (rows, width), from the largest.

    Args:
        scores: (rows, columns) fp32, bf16 or fp16 scores without NaN (log-probs or logits; -inf allowed).
        width: entries per row, at most the number of columns.
    """
    # fp32 is exact for bf16 and fp16 values; + 0.0 makes -0.0 +0.0 (equal scores, equal keys).
    bits = (scores.float() + 0.0).contiguous().view(torch.int32)
    # fp32 bits as an integer that increases with the float: a negative float's magnitude bits are flipped.
    ordered = torch.where(bits < 0, bits ^ _LOW_BITS, bits).to(torch.int64)
    columns = scores.shape[1]
    descending_column = torch.arange(columns - 1, -1, -1, device=scores.device)  # lower columns rank higher
    keys = ordered * (1 << 32) + descending_column  # |ordered| < 2^31: no overflow
    where = keys.topk(width, dim=-1).indices
    return scores.gather(1, where), where


@dataclass
class Candidates:
    """Each row's top candidates after the warpers (`warpers.warp_candidates`) and the one it drew."""

    values: torch.Tensor  # (rows, width) warped scores, in token id order (-inf: removed)
    ids: torch.Tensor  # (rows, width) their token ids, increasing
    position: torch.Tensor  # (rows,) the drawn candidate's column


def sampled_logprobs(
    slots: SamplingSlots,
    raw: torch.Tensor,
    scores: torch.Tensor,
    columns: SlotColumns,
    token_ids: torch.Tensor,
    candidates: Candidates | None,
    top_width: int,
    batch_invariant: bool,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(chosen log-probs, top (values, token ids) or None): a row's chosen log-prob is its token's score minus the
    logsumexp of its row (no log_softmax of whole rows); top entries are the top scores minus it. Sampled
    "processed" rows take them from their candidates when the step drew from candidates.

    Args:
        slots: the live slots (which logprob modes they use).
        raw: (rows, vocab) fp32 model logits.
        scores: (rows, vocab) the scores drawn from (processed mode's distribution).
        columns: the rows' sampling parameters.
        token_ids: (rows,) the drawn tokens.
        candidates: the candidates the step drew from (None: whole rows).
        top_width: the most top log-probs a row asks for (0: none).
        batch_invariant: whole rows' log-probs as `torch.log_softmax` then a gather, as a trainer computes them.
    """
    width = top_width
    from_candidates = None
    if candidates is not None:
        lse = candidates.values.logsumexp(dim=-1, keepdim=True)
        chosen = (candidates.values.gather(1, candidates.position.unsqueeze(1)) - lse).squeeze(1)
        top = None
        if width:
            values, where = top_entries(candidates.values, width)  # candidates are in token id order
            top = values - lse, _removed_as_in_whole_rows(values, candidates.ids.gather(1, where), candidates)
        if slots.all_use("sampled") and slots.all_use("logprob_mode:processed"):
            return chosen, top
        from_candidates = (columns.int("use_processed") * (1 - columns.int("greedy"))).bool()
    source = _logprob_source(slots, raw, scores, columns)
    if batch_invariant:
        source, lse = invariant_log_softmax(source), 0.0
    else:
        lse = source.logsumexp(dim=-1, keepdim=True)
    full_chosen = (source.gather(1, token_ids.unsqueeze(1)) - lse).squeeze(1)
    full_top = None
    if width:
        values, indices = top_entries(source, width)
        full_top = values - lse, indices
    if from_candidates is None:
        return full_chosen, full_top
    chosen = torch.where(from_candidates, chosen, full_chosen)
    if width:
        pick = from_candidates.unsqueeze(1)
        top = torch.where(pick, top[0], full_top[0]), torch.where(pick, top[1], full_top[1])
    return chosen, top


def _removed_as_in_whole_rows(values: torch.Tensor, ids: torch.Tensor, candidates: Candidates) -> torch.Tensor:
    """Top entries' token ids where the row has fewer finite candidates than entries asked: its -inf entries name the
    lowest token ids outside its finite candidates, as a whole row's do (every token outside them is -inf there,
    equal scores in token id order), not the lowest removed candidates: a row's entries then do not depend on
    whether its step drew from candidates.

    Args:
        values: (rows, width) the top entries' scores, from the largest (-inf last).
        ids: (rows, width) their token ids.
        candidates: the candidates they were taken from.
    """
    width, span = ids.shape[1], candidates.ids.shape[1] + ids.shape[1]
    finite = torch.where(torch.isfinite(candidates.values), candidates.ids, -1)  # (rows, m)
    # The `width` lowest ids outside at most m finite ones lie below m + width.
    low = torch.arange(span, device=ids.device)
    inside = (low.view(1, span, 1) == finite.unsqueeze(1)).any(dim=-1)  # (rows, span)
    outside = (inside.long() * span + low).topk(width, dim=-1, largest=False).values  # inside ones rank last
    kept = torch.isfinite(values).sum(dim=-1, keepdim=True)  # finite entries first
    nth_outside = (torch.arange(width, device=ids.device) - kept).clamp(min=0)
    return torch.where(torch.isfinite(values), ids, outside.gather(1, nth_outside))


def _logprob_source(
    slots: SamplingSlots, raw: torch.Tensor, scores: torch.Tensor, columns: SlotColumns
) -> torch.Tensor:
    """The logits each row's log-probs are the log_softmax of, by its logprob_mode (see the `Sampler` docstring)."""
    if not slots.any("logprob_mode:raw") and not slots.any("logprob_mode:temperature_scaled"):
        return scores
    unprocessed = raw
    if slots.any("logprob_mode:temperature_scaled"):
        unprocessed = raw / columns.float("logprob_divisor")
    if not slots.any("logprob_mode:processed"):
        return unprocessed
    return torch.where(columns.int("use_processed").bool().unsqueeze(1), scores, unprocessed)
