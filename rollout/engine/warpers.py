"""Steps 4-10 of the sampling pipeline on the rows that sample: temperature, top_k, top_p, min_p, typical_p,
epsilon_cutoff, eta_cutoff, in transformers' order and with its warpers' semantics (one token always survives).
Each step runs only when some row asks for it, and a row that does not ask is left as it was."""

from __future__ import annotations

import torch

from rollout.config import SamplingParams
from rollout.engine.transfer import to_device

_NEG_INF = float("-inf")


def warp(scores: torch.Tensor, params: list[SamplingParams], vocab_size: int) -> torch.Tensor:
    """Return the warped scores of the sampling rows.

    Args:
        scores: (rows, vocab) fp32 scores after penalties, bans and min_new_tokens.
        params: each row's sampling parameters.
        vocab_size: the vocabulary width (top_k is capped at it).
    """
    device = scores.device

    def column(values: list[float]) -> torch.Tensor:
        return to_device(values, scores.dtype, device).unsqueeze(1)

    scores = scores / column([p.temperature for p in params])
    if any(p.top_k for p in params):
        top_ks = [min(p.top_k or vocab_size, vocab_size) for p in params]
        k = to_device(top_ks, torch.long, device)
        kth = scores.topk(max(top_ks), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        scores = scores.masked_fill(scores < kth, _NEG_INF)
    if any(p.top_p < 1 for p in params):
        sorted_scores, sorted_index = scores.sort(dim=-1, descending=False)
        remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= 1 - column([p.top_p for p in params])
        remove[:, -1] = False
        scores = scores.masked_fill(remove.scatter(1, sorted_index, remove), _NEG_INF)
    if any(p.min_p > 0 for p in params):
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(
            probs < column([p.min_p for p in params]) * probs.amax(dim=-1, keepdim=True), _NEG_INF
        )
    if any(p.typical_p < 1 for p in params):
        typical = _typical(scores, column([p.typical_p for p in params]))
        enabled = to_device([p.typical_p < 1 for p in params], torch.bool, device).unsqueeze(1)
        scores = torch.where(enabled, typical, scores)
    if any(p.epsilon_cutoff > 0 for p in params):
        scores = _cut_below(scores, scores.softmax(dim=-1), column([p.epsilon_cutoff for p in params]))
    if any(p.eta_cutoff > 0 for p in params):
        eta = column([p.eta_cutoff for p in params])
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
