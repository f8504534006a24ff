"""Steps 4-10 of the sampling pipeline on the rows that sample: temperature, top_k, top_p, min_p, typical_p,
epsilon_cutoff, eta_cutoff, in transformers' order and with its warpers' semantics (one token always survives).
Each step runs only when some running sample asks for it, and a row that does not ask is left as it was."""

from __future__ import annotations

import torch

from rollout.engine.sampling_slots import SamplingSlots, SlotColumns

_NEG_INF = float("-inf")


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
    if slots.any("top_p"):
        top_p = columns.float("top_p")
        sorted_scores, sorted_index = scores.sort(dim=-1, descending=False)
        remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        if not slots.all_use("top_p"):
            remove &= top_p < 1
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
        log_probs = scores.log_softmax(dim=-1)
        probs = log_probs.exp()
        # Entropy as torch.distributions.Categorical computes it (-inf clamped, so 0 * -inf is 0, not nan).
        entropy = -(log_probs.clamp(min=torch.finfo(scores.dtype).min) * probs).sum(dim=-1, keepdim=True)
        scores = _cut_below(scores, probs, torch.minimum(eta, eta.sqrt() * torch.exp(-entropy)))
    return scores


def _typical(scores: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """transformers' TypicalLogitsWarper with a per-row mass: keep the tokens whose surprise is closest to the
    entropy until their probability reaches `mass`."""
    normalized = scores.log_softmax(dim=-1)
    probs = normalized.exp()
    entropy = -(normalized * probs).nansum(dim=-1, keepdim=True)
    shifted = (-normalized - entropy).abs()
    sorted_shifted, sorted_index = shifted.sort(dim=-1, descending=False)
    cumulative = scores.gather(-1, sorted_index).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=1).clamp_(max=scores.shape[-1] - 1)
    remove = sorted_shifted > sorted_shifted.gather(1, last.unsqueeze(1))
    remove[:, :1] = False
    return scores.masked_fill(remove.scatter(1, sorted_index, remove), _NEG_INF)


def _cut_below(scores: torch.Tensor, probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below the row's threshold, except the top one (epsilon and eta sampling)."""
    top = scores.amax(dim=-1, keepdim=True)
    return scores.masked_fill((probs < threshold) & (scores < top), _NEG_INF)
