"""Constraints that compile but can never be followed, found before a request is admitted (else its samples would
end with an error at their first impossible step, a 500 over HTTP):

- `first_step_refusal`: the grammar allows no token at the first step, and is not complete (a regex `[^\\s\\S]`, a
  character no token of the vocabulary spells);
- `too_short_refusal`: with `min_new_tokens`, the request's stop tokens are masked until that many tokens came;
  a grammar whose every path ends before that (only its end tokens allowed) leaves a sample nothing to draw (a choice
  `["a"]` with `min_tokens: 3`), or, where its end token is not one of the request's stop tokens (`stop_token_ids`
  empty or other tokens), ends the sample there, short of min_new_tokens: refused alike.

Both walk xgrammar's own matcher over the vocabulary, so they say exactly what the engine's masks would. The second
is a depth-first search over tokens, shortest first (the longest paths first), bounded in mask fills and CPU time: it
refuses only when it has seen every path; past its budget it admits the request (the engine then ends a stuck sample
by name).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np

try:
    import xgrammar
except ImportError:  # without the extra nothing compiles, so nothing is checked
    xgrammar = None

MAX_CHECK_FILLS = 256  # token masks one min_new_tokens check may fill (about 0.1 ms each on a 150k vocabulary)
# CPU seconds one min_new_tokens check may take. A fill's cost is not bounded by the vocabulary alone: under a nested
# repetition (`root ::= ((((("a")+)+)+)+)+`) the matcher's state grows with the path, and 256 fills down one path took
# 44 s of a core on a 1,024-token vocabulary. A check cut by either bound admits the request.
MAX_CHECK_S = 0.5
# A search reads a filled mask lazily, in its order of tokens: a mask of at most SPARSE_WORDS nonzero 32-bit words
# (a few tokens allowed) is read whole; a denser one (a JSON string allows most of the vocabulary, and the search
# mostly takes its first token) SCAN_CHUNK tokens of the order at a time. Reading every allowed token into a list at
# each fill cost ~10 ms on a 150k vocabulary, and a step's search makes up to 256 fills.
SPARSE_WORDS = 64
SCAN_CHUNK = 512


def allowed_tokens(matcher: Any, bitmask: Any, vocab_size: int) -> np.ndarray:
    """The token ids the matcher allows next (sorted).

    Args:
        matcher: an xgrammar GrammarMatcher.
        bitmask: a (1, words) int32 buffer from `xgrammar.allocate_token_bitmask` (overwritten).
        vocab_size: the grammar's vocabulary size.
    """
    matcher.fill_next_token_bitmask(bitmask)
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def first_step_refusal(compiled: Any) -> str | None:
    """Why a compiled grammar can never be followed from its start (None: some token is allowed, or it is complete).

    Args:
        compiled: an xgrammar CompiledGrammar.
    """
    matcher = xgrammar.GrammarMatcher(compiled)
    vocab_size = compiled.tokenizer_info.vocab_size
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    if len(allowed_tokens(matcher, bitmask, vocab_size)) or matcher.is_terminated():
        return None
    return "allows no token at the first step: no token of this model's vocabulary starts a string it accepts"


def too_short_refusal(compiled: Any, min_tokens: int, banned: frozenset[int], order: np.ndarray) -> str | None:
    """Why a grammar cannot give `min_tokens` tokens while `banned` (the request's stop tokens) are masked: every
    path it allows ends before, on its end token (which ends the sample even when it is not banned) or where only
    banned tokens are left (None: a path reaches it, or the search ran out).

    Args:
        compiled: an xgrammar CompiledGrammar.
        min_tokens: the request's min_new_tokens.
        banned: the tokens masked until min_tokens tokens came (its stop tokens; may be empty).
        order: every token id, shortest decoded first (tried in this order: shorter tokens make longer paths).
    """
    if min_tokens <= 0:
        return None
    longest = _longest_path(compiled, min_tokens, banned, order)
    if longest is None or longest >= min_tokens:
        return None
    return (
        f"cannot give min_tokens={min_tokens} tokens: every output it accepts ends after at most {longest} "
        "(its end, or only stop tokens, comes first; stop tokens are masked until min_tokens)"
    )


def token_ranks(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """Each token id's place in `tokens` (-1 for an id not there: an end token).

    Args:
        tokens: the tokens a path search tries, in order (`path_order`).
        vocab_size: the grammar's vocabulary size.
    """
    ranks = np.full(vocab_size, -1, dtype=np.int64)
    ranks[tokens] = np.arange(len(tokens))
    return ranks


def mask_ids(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a filled mask allows, ascending, read from its nonzero words only.

    Args:
        words: the mask row as uint32 words.
        vocab_size: the grammar's vocabulary size (bits past it are not tokens).
    """
    nonzero = np.flatnonzero(words)
    bits = np.unpackbits(np.ascontiguousarray(words[nonzero]).view(np.uint8), bitorder="little").reshape(-1, 32)
    rows, columns = np.nonzero(bits)
    ids = nonzero[rows] * 32 + columns
    return ids[ids < vocab_size]


def allowed_in_order(words: np.ndarray, tokens: np.ndarray, ranks: np.ndarray) -> Iterator[int]:
    """The tokens of `tokens` a filled mask allows, in their order, read lazily (`SPARSE_WORDS`).

    Args:
        words: the mask row as uint32 words (a copy the caller does not change while it iterates).
        tokens: the tokens a path may take, in the order tried.
        ranks: `token_ranks(tokens, vocab_size)`.
    """
    if np.count_nonzero(words) <= SPARSE_WORDS:
        found = ranks[mask_ids(words, len(ranks))]
        yield from tokens[np.sort(found[found >= 0])].tolist()
        return
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = tokens[start : start + SCAN_CHUNK]
        hits = (words[chunk >> 5] >> (chunk & 31).astype(np.uint32)) & 1
        yield from chunk[hits.astype(bool)].tolist()


def path_order(order: np.ndarray, ends: frozenset[int] | set[int]) -> np.ndarray:
    """The tokens a path search tries, shortest decoded first: `order` without `ends` (a path stops there).

    Args:
        order: every token id, shortest decoded first.
        ends: the tokens that end a path (the grammar's end tokens, and stop tokens masked until min_new_tokens).
    """
    return order[~np.isin(order, np.fromiter(ends, dtype=np.int64, count=len(ends)))]


def longest_path(
    matcher: Any,
    vocab_size: int,
    needed: int,
    tokens: np.ndarray,
    max_fills: int,
    ranks: np.ndarray | None = None,
    max_seconds: float | None = None,
) -> tuple[int | None, int]:
    """(the longest path of `tokens` the matcher allows from where it stands, once it is below `needed`; `needed` as
    soon as one reaches it; None when the search ran out of mask fills or CPU time first, the mask fills it made).
    Depth first, trying `tokens` in their order; the matcher is left as found (xgrammar's rollbacks are unlimited
    since 0.2).

    Args:
        matcher: an xgrammar GrammarMatcher, not terminated.
        vocab_size: the grammar's vocabulary size.
        needed: the path length that is enough.
        tokens: the tokens a path may take, in the order tried (`path_order`).
        max_fills: the most token masks the search may fill.
        ranks: `token_ranks(tokens, vocab_size)` (computed here when not given).
        max_seconds: the most CPU time (this thread's) the search may take, checked before each fill (None: no
            bound but the fills).
    """
    if needed <= 0:
        return needed, 0
    deadline = None if max_seconds is None else time.thread_time() + max_seconds
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    words = bitmask[0].numpy().view(np.uint32)  # one view of its memory: no torch operator per fill
    ranks = token_ranks(tokens, vocab_size) if ranks is None else ranks
    fills = 0

    def candidates() -> Iterator[int]:
        """The tokens to try next, in order (read from a copy: deeper levels fill the bitmask again)."""
        nonlocal fills
        fills += 1
        matcher.fill_next_token_bitmask(bitmask)
        return allowed_in_order(words.copy(), tokens, ranks)

    stack, longest = [candidates()], 0
    while stack:
        token = next(stack[-1], None)
        if token is None:  # every token from here tried: back up one
            stack.pop()
            if stack:
                matcher.rollback(1)
            continue
        if not matcher.accept_token(token):
            continue
        depth = len(stack)  # tokens accepted on this path
        longest = max(longest, depth)
        if depth >= needed or fills >= max_fills or (deadline is not None and time.thread_time() > deadline):
            matcher.rollback(depth)
            return (needed if depth >= needed else None), fills
        stack.append(candidates())
    return longest, fills


def _longest_path(compiled: Any, needed: int, banned: frozenset[int], order: np.ndarray) -> int | None:
    """`longest_path` from the grammar's start, over tokens not banned. The grammar's end tokens (xgrammar's stop
    tokens) end a path whether banned or not: the engine ends a sample whose grammar completed."""
    info = compiled.tokenizer_info
    tokens = path_order(order, set(banned) | set(info.stop_token_ids))
    matcher = xgrammar.GrammarMatcher(compiled)
    return longest_path(matcher, info.vocab_size, needed, tokens, MAX_CHECK_FILLS, max_seconds=MAX_CHECK_S)[0]
