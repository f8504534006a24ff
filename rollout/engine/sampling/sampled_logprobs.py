"""The log-probs of a step's drawn tokens (`Sampler`, last in its pass): each row's chosen log-prob and its top
entries, from the distribution its `logprob_mode` names (see the `Sampler` docstring), computed from the candidates
a step drew from where every row's log-probs are theirs, else from whole rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.engine.sampling.slot_columns import SlotColumns
from rollout.engine.sampling.slots import SamplingSlots
from rollout.engine.sampling.top_entries import top_entries
from rollout.invariant.reductions import invariant_log_softmax


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
