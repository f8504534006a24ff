"""What each sample bans, in the sampling pipeline (`Sampler`): tokens it may not generate next (transformers' semantics
of `no_repeat_ngram_size`, `bad_words_ids`, `suppress_tokens` and `begin_suppress_tokens`), as the lists the per-slot
tables are built from (`rollout.engine.sampling.slot_state`; the masks: `rollout.engine.sampling.ban_masks`).
`SamplingParams` bounds every list, so no request can make steps slow. What a request never generates, and what it
may not generate first, are the request's own (`rollout.engine.requests.bans`).
"""

from __future__ import annotations

from rollout.config import SamplingParams


def has_bans(params: SamplingParams) -> bool:
    """True when the request bans any token (cheap: the sampler asks it for every row of every step)."""
    return bool(
        params.no_repeat_ngram_size or params.bad_words_ids or params.suppress_tokens or params.begin_suppress_tokens
    )


def has_history(params: SamplingParams) -> bool:
    """True when the request's bans read its latest tokens (no_repeat_ngram_size, multi-token bad words)."""
    return bool(params.no_repeat_ngram_size) or any(len(word) > 1 for word in params.bad_words_ids)


def multi_token_words(params: SamplingParams) -> list[tuple[int, ...]]:
    """The bad words of more than one token (their last token is banned after the others)."""
    return [word for word in params.bad_words_ids if len(word) > 1]
