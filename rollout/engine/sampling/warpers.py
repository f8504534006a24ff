"""The warpers of the sampling pipeline (`Sampler`) on the rows that sample: temperature, top_k, top_p, min_p,
typical_p, epsilon_cutoff, eta_cutoff, in transformers' order and with its warpers' semantics (one token always
survives). Each step runs only when some running sample asks for it, and a row that does not ask is left as it was.

`warp` works on whole rows of the vocabulary. `warp_candidates` (when every sampling row sets top_k) works on each
row's top candidates only: `topk` first, then every later warper on those few columns, kept in vocabulary order so
that drawing from them walks the same CDF as a whole row would. Both give the same kept tokens
and probabilities (up to float rounding), except where more than `TIE_SLACK` tokens tie exactly with a row's k-th
score (see `candidate_width`), or a token's probability lies within float rounding of a min_p, epsilon or eta cut (a
softmax over the candidates rounds its sum otherwise than one over the whole row).

Sorts are stable on both paths, so tokens whose probabilities tie exactly at a top_p or typical_p boundary are taken
in token id order whatever the path (which depends on the other live samples) and the device. transformers' warpers
sort unstably: on a CPU its order among exact ties is the sort's own, so there it may keep another of the tied
tokens."""

from __future__ import annotations

import torch

from rollout.engine.sampling.slot_columns import SlotColumns
from rollout.engine.sampling.slots import SamplingSlots

_NEG_INF = float("-inf")
# Candidates taken beyond the largest top_k: tokens tied with a row's k-th score are all kept (transformers'
# semantics), so the candidates must hold them too.
TIE_SLACK = 64


def warp(scores: torch.Tensor, columns: SlotColumns, slots: SamplingSlots) -> torch.Tensor:
    """Return the warped scores of every row (greedy rows too: the caller keeps their unwarped scores).

    Args:
        scores: (rows, vocab) fp32 scores after penalties, bans and min_new_tokens.
        columns: each row's sampling parameters (`SamplingSlots.gather`); a row that does not ask for a warper
            holds its neutral value, so running the warper over it leaves it as it was.
        slots: the slot tables, whose live-slot counts skip the warpers that no running sample asks for.
    """
    scores = scores / columns.float("temperature")
    width = slots.max_top_k()
    if width and slots.one_top_k():  # the same top_k for every row: no per-row k to gather or check
        scores = scores.masked_fill(scores < scores.topk(width, dim=-1).values[:, -1:], _NEG_INF)
    elif width:
        k = columns.int("top_k")
        kth = scores.topk(width, dim=-1).values.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))
        # Rows without top_k hold the vocabulary size: more than `width`, so they are left alone.
        scores = scores.masked_fill((scores < kth) & (k <= width).unsqueeze(1), _NEG_INF)
    return _after_top_k(scores, columns, slots)


def candidate_width(slots: SamplingSlots, top_logprobs: int) -> int:
    """How many candidates `warp_candidates` takes per row: the largest top_k and TIE_SLACK more (or the
    largest top_k once again, if more), at least `top_logprobs` (top log-probs come from the candidates), at most
    the vocabulary. Only a row with more tokens tied exactly with its k-th score than the candidates hold differs
    from a whole row: it keeps the tied tokens among its candidates, where transformers keeps them all.

    Args:
        slots: the slot tables (their largest top_k).
        top_logprobs: the most top log-probs a row of the step asks for.
    """
    width = slots.max_top_k()
    return min(slots.vocab_size, max(width + max(width, TIE_SLACK), top_logprobs))


def warp_candidates(
    scores: torch.Tensor, columns: SlotColumns, slots: SamplingSlots, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature and every warper over each row's top `width` candidates (every sampling row sets top_k).

    Returns (values, token_ids), both (rows, width) in increasing token id order: the candidates' warped scores
    (-inf where a warper removed one) and their token ids. Greedy rows come out meaningless (the caller keeps their
    unwarped scores).

    Args:
        scores: (rows, vocab) fp32 scores after penalties, bans and min_new_tokens.
        columns: each row's sampling parameters.
        slots: the slot tables.
        width: candidates per row (`candidate_width`).
    """
    # Dividing by a positive temperature keeps the order: the top candidates of the divided scores are these (ties
    # that the division's rounding makes stay among them, like the ties of the scores themselves).
    values, token_ids = scores.topk(width, dim=-1)
    values = values / columns.float("temperature")
    top_k = slots.max_top_k()
    if slots.one_top_k():
        kth = values[:, top_k - 1 : top_k]
    else:  # greedy rows may hold the vocabulary size (or another top_k): clamped, their result is not used
        kth = values.gather(1, (columns.int("top_k").clamp(max=top_k) - 1).unsqueeze(1))
    values = values.masked_fill(values < kth, _NEG_INF)
    # Token id order: the CDF walks the candidates as a whole row would, and the stable sorts of `_after_top_k` break
    # ties by token id, as they do on whole rows.
    token_ids, order = token_ids.sort(dim=-1)
    values = values.gather(1, order)
    return _after_top_k(values, columns, slots), token_ids


def _after_top_k(scores: torch.Tensor, columns: SlotColumns, slots: SamplingSlots) -> torch.Tensor:
    """Steps 6-10 (top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff) on whole rows or on candidates: a removed
    token holds -inf, so every warper sees the same distribution either way.

    Args:
        scores: (rows, columns) scores after top_k.
        columns: each row's sampling parameters.
        slots: the slot tables (which warpers some live sample asks for).
    """
    if slots.any("top_p"):
        # fp32(1 - top_p computed in double), as transformers compares with it: 1 - fp32(top_p) can differ by an
        # ulp, and a cumulative probability between the two drops a token transformers keeps.
        cut = columns.float("top_p_cut")
        sorted_scores, sorted_index = scores.sort(dim=-1, descending=False, stable=True)
        remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= cut
        if not slots.all_use("top_p"):
            remove &= cut > 0
        remove[:, -1] = False
        scores = scores.masked_fill(remove.scatter(1, sorted_index, remove), _NEG_INF)
    if slots.any("min_p"):
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < columns.float("min_p") * probs.amax(dim=-1, keepdim=True), _NEG_INF)
    if slots.any("typical_p"):
        typical_p = columns.float("typical_p")
        scores = torch.where(typical_p < 1, _typical(scores, typical_p), scores)
    if slots.any("epsilon_cutoff"):
        scores = _cut_below(scores, scores.softmax(dim=-1), columns.float("epsilon_cutoff"))
    if slots.any("eta_cutoff"):
        eta = columns.float("eta_cutoff")
        # As transformers' EtaLogitsWarper: the entropy of torch.distributions.Categorical(logits=scores) (its logits
        # normalised by their logsumexp, -inf clamped so 0 * -inf is 0, its probs their softmax), and the cut on
        # softmax(scores). log_softmax and its exp round differently and moved tokens across the cut.
        normalized = scores - scores.logsumexp(dim=-1, keepdim=True)
        entropy = -(normalized.clamp(min=torch.finfo(scores.dtype).min) * normalized.softmax(dim=-1)).sum(
            -1, keepdim=True
        )
        scores = _cut_below(scores, scores.softmax(dim=-1), torch.minimum(eta, eta.sqrt() * torch.exp(-entropy)))
    return scores


def _typical(scores: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """transformers' TypicalLogitsWarper with a per-row mass: keep the tokens whose surprise is closest to the
    entropy until their probability reaches `mass`."""
    normalized = scores.log_softmax(dim=-1)
    probs = normalized.exp()
    entropy = -(normalized * probs).nansum(dim=-1, keepdim=True)
    shifted = (-normalized - entropy).abs()
    sorted_shifted, sorted_index = shifted.sort(dim=-1, descending=False, stable=True)
    cumulative = scores.gather(-1, sorted_index).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=1).clamp_(max=scores.shape[-1] - 1)
    remove = sorted_shifted > sorted_shifted.gather(1, last.unsqueeze(1))
    remove[:, :1] = False
    return scores.masked_fill(remove.scatter(1, sorted_index, remove), _NEG_INF)


def _cut_below(scores: torch.Tensor, probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below the row's threshold, except the top one (epsilon and eta sampling)."""
    top = scores.amax(dim=-1, keepdim=True)
    return scores.masked_fill((probs < threshold) & (scores < top), _NEG_INF)
