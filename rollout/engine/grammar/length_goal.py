"""A constrained sample kept on paths long enough for its min_new_tokens.

Until a sample has min_new_tokens tokens, its stop tokens and its grammar's end tokens are masked. A grammar may
allow a branch that ends sooner (the choice `["xy", "xzzzzzzzzz"]` with min_new_tokens 4: after "x", "y" leaves
only the end): a sample that took it would have nothing left to draw. The admission check (checks.py) refuses a
grammar whose every path is too short; this one, at each step before min_new_tokens, masks every token after which
no path is long enough, so a sample never walks into such a branch.

Each allowed token is tried on the sample's own matcher (then rolled back), with a depth-first search of the paths
after it (checks.py's `longest_path`). The search is bounded so that it never slows a step much: a row is pruned
only when its grammar allows at most MAX_CANDIDATES tokens there (a choice, a small regex; a JSON string allows
thousands, and its paths can always be made longer), each row spends at most MAX_ROW_FILLS mask fills a step, and
a token whose search ran out is kept. The bound is the row's own, never shared with the step's other rows: what a
sample is kept from depends on its grammar and its tokens alone, not on what else runs (a seed gives the same tokens
whatever the batch). Where a search was cut, a sample may still come to a dead end: it then ends with an error
naming its grammar and min_new_tokens, as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout.engine.grammar.checks import longest_path, mask_ids, path_order, token_ranks

MAX_CANDIDATES = 16  # a row is pruned only when its grammar allows at most this many tokens (its ends left out)
MAX_ROW_FILLS = 32  # token masks the pruning of one row may fill a step (its own: never shared with other rows)


@dataclass(frozen=True)
class LengthGoal:
    """What a constrained sample must reach: `min_tokens` tokens before any of `ends` may come."""

    min_tokens: int  # the request's min_new_tokens
    ends: np.ndarray  # the tokens masked until then: the request's stop tokens and the grammar's end tokens
    tokens: np.ndarray  # every other token id, shortest decoded first (the order a path search tries them)
    ranks: np.ndarray  # each token id's place in `tokens` (-1: one of `ends`)

    @classmethod
    def of(cls, min_tokens: int, ends: frozenset[int], order: np.ndarray) -> LengthGoal:
        """The goal of a request.

        Args:
            min_tokens: the request's min_new_tokens.
            ends: the tokens masked until then.
            order: every token id, shortest decoded first.
        """
        tokens = path_order(order, ends)
        return cls(
            min_tokens, np.fromiter(ends, dtype=np.int64, count=len(ends)), tokens, token_ranks(tokens, len(order))
        )


def prune_short_paths(
    matcher: Any,
    vocab_size: int,
    goal: LengthGoal,
    generated: int,
    words: np.ndarray,
    budget: int,
    max_seconds: float | None = None,
) -> int:
    """Clear, in a row of the step's bitmask, every token after which the grammar allows no path long enough to reach
    `goal.min_tokens`; returns the mask fills spent (at most `budget`).

    Args:
        matcher: the sample's xgrammar GrammarMatcher, advanced past its `generated` tokens (left as found).
        vocab_size: the grammar's vocabulary size.
        goal: the sample's length goal.
        generated: the tokens the sample has (this step draws the next one); below `goal.min_tokens`.
        words: the sample's bitmask row, filled by its grammar, as uint32 words (changed in place).
        budget: the most mask fills to spend.
        max_seconds: the most CPU time to spend (None: no bound but the fills); a token whose search it cut is kept.
    """
    # Each nonzero word allows a token at least, of which at most len(goal.ends) are ends: a mask allowing many tokens
    # (a JSON string: most of the vocabulary) is passed over without reading it (that read cost ~2 ms a row).
    if np.count_nonzero(words) > MAX_CANDIDATES + len(goal.ends):
        return 0
    allowed = mask_ids(words, vocab_size)
    candidates = allowed[goal.ranks[allowed] >= 0]
    if len(candidates) > MAX_CANDIDATES:
        return 0
    needed = goal.min_tokens - generated - 1  # tokens still to come after this step's, before an end may
    spent = 0
    deadline = None if max_seconds is None else time.thread_time() + max_seconds
    for token in candidates.tolist():
        left = None if deadline is None else deadline - time.thread_time()
        if spent >= budget or (left is not None and left <= 0):
            break
        if not matcher.accept_token(token):
            continue
        longest, fills = longest_path(matcher, vocab_size, needed, goal.tokens, budget - spent, goal.ranks, left)
        matcher.rollback(1)
        spent += fills
        if longest is not None and longest < needed:  # every path after it ends too soon
            words[token // 32] &= ~np.uint32(1 << (token % 32))
    return spent
