"""Step 2 of the sampling pipeline: tokens a request may not generate next, set to -inf (transformers' semantics of
`no_repeat_ngram_size`, `bad_words_ids`, `suppress_tokens` and `begin_suppress_tokens`).

A request's bans become device tensors once, at its first draw: per step each banning row costs a few tensor ops
whatever the number of banned tokens or words (words are matched a whole length group at a time). Bans that depend
on the latest tokens (n-grams, multi-token bad words) read a per-request token history on the device, appended on the
device after each draw: with overlapped scheduling the newest token is not on the host yet when the next step is
sampled, and nothing here waits for it. `SamplingParams` bounds every list, so no request can make steps slow.

That per-request state is the "sampler_state" previous path (`ContinuousBatchingConfig.previous_paths`); by default
the same bans read per-slot tables for all rows at once (`rollout.engine.slot_bans`), built from the same lists
(`always_banned`, `multi_token_words`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout.config import SamplingParams
from rollout.engine.request import Request
from rollout.engine.transfer import to_device

_NEG_INF = float("-inf")


@dataclass
class Bans:
    """One request's bans on the device."""

    always: torch.Tensor | None  # token ids never generated (suppress_tokens, single-token bad words)
    first: torch.Tensor | None  # token ids not generated as the first token (begin_suppress_tokens)
    # Multi-token bad words by length: (prefix length k, prefixes (m, k), their last tokens (m,)).
    words: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    ngram: int = 0  # no_repeat_ngram_size
    history: torch.Tensor | None = None  # the request's tokens, when n-grams or words need them


def has_bans(params: SamplingParams) -> bool:
    """True when the request bans any token (cheap: the sampler asks it for every row of every step)."""
    return bool(
        params.no_repeat_ngram_size or params.bad_words_ids or params.suppress_tokens or params.begin_suppress_tokens
    )


def has_history(params: SamplingParams) -> bool:
    """True when the request's bans read its latest tokens (no_repeat_ngram_size, multi-token bad words)."""
    return bool(params.no_repeat_ngram_size) or any(len(word) > 1 for word in params.bad_words_ids)


def always_banned(request: Request) -> list[int]:
    """Sorted token ids the request never generates: suppress_tokens and single-token bad words, except that a
    single-token bad word that is a stop token is kept allowed, as transformers does."""
    params = request.sampling
    single = [w[0] for w in params.bad_words_ids if len(w) == 1 and w[0] not in request.stop_token_ids]
    return sorted(set(params.suppress_tokens).union(single))


def multi_token_words(params: SamplingParams) -> list[tuple[int, ...]]:
    """The bad words of more than one token (their last token is banned after the others)."""
    return [word for word in params.bad_words_ids if len(word) > 1]


def build_bans(request: Request, device: torch.device) -> Bans:
    """The request's bans as device tensors (at its first draw, when all its tokens are on the host)."""
    params = request.sampling

    def ids(tokens: list[int]) -> torch.Tensor | None:
        return to_device(tokens, torch.long, device) if tokens else None

    by_length: dict[int, list[tuple[int, ...]]] = {}
    for word in multi_token_words(params):
        by_length.setdefault(len(word) - 1, []).append(word)
    words = [
        (
            k,
            to_device([w[:-1] for w in group], torch.long, device),
            to_device([w[-1] for w in group], torch.long, device),
        )
        for k, group in sorted(by_length.items())
    ]
    bans = Bans(ids(always_banned(request)), ids(sorted(set(params.begin_suppress_tokens))), words)
    bans.ngram = params.no_repeat_ngram_size
    if bans.ngram or words:
        if request.has_placeholder:
            raise RuntimeError(f"token history of {request.request_id} built before its last token was resolved")
        bans.history = torch.zeros(request.num_prompt_tokens + request.max_new_tokens, dtype=torch.long, device=device)
        bans.history[: request.num_tokens] = to_device(request.token_ids, torch.long, device)
    return bans


def apply_bans(scores: torch.Tensor, bans: Bans, length: int, num_output_tokens: int) -> None:
    """Set the banned tokens of one row to -inf, in place, on the device.

    Args:
        scores: (vocab,) the row.
        bans: the request's bans.
        length: how many tokens the request has (a host count, exact even while the newest value is on the device).
        num_output_tokens: how many of them it generated.
    """
    if bans.always is not None:
        scores.index_fill_(0, bans.always, _NEG_INF)
    if bans.first is not None and num_output_tokens == 0:
        scores.index_fill_(0, bans.first, _NEG_INF)
    if bans.history is None:
        return
    penalty = torch.zeros_like(scores)
    n = bans.ngram
    if n and length >= n:
        windows = bans.history[:length].unfold(0, n, 1)  # every n-gram so far
        repeats = (windows[:, :-1] == bans.history[length - n + 1 : length]).all(dim=1)  # those starting as the next
        penalty.scatter_reduce_(0, windows[:, -1], torch.where(repeats, _NEG_INF, 0.0), reduce="amin")
    for k, prefixes, lasts in bans.words:
        if k <= length:  # a word whose prefix ends the tokens so far
            matches = (prefixes == bans.history[length - k : length]).all(dim=1)
            penalty.scatter_reduce_(0, lasts, torch.where(matches, _NEG_INF, 0.0), reduce="amin")
    scores.add_(penalty)


def record(bans: Bans, length: int, token: torch.Tensor) -> None:
    """Append a drawn token (a one-element device tensor) at position `length` of the history, on the device."""
    if bans.history is not None:
        bans.history[length : length + 1].copy_(token)
