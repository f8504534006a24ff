"""One prompt's draft pool: the token sequences sampled from one prompt (its group's samples, running or finished, and
earlier rounds' samples of the same prompt), indexed by their windows of `KEY` tokens, from which a sample's likely
continuation is proposed: the tokens that followed the longest earlier match of the sample's own last tokens.

The index is lazy: a sequence is indexed up to its current end only when a proposal is asked for (in the long tail),
once per step, so a full batch pays nothing per token. Each sequence is a reference to a sample's own token list, which grows as the
sample's tokens resolve; a placeholder at its end (a token still on the device) is never indexed or proposed.
Torch-free, as the scheduler that asks for proposals.
"""

from __future__ import annotations

from rollout.engine.requests.request import PLACEHOLDER_TOKEN

KEY = 2  # tokens in an index key (a token and the one before it): the shortest match a proposal follows
MAX_MATCH = 64  # a match is measured up to this many tokens
CANDIDATES = 16  # the latest occurrences of a key examined per proposal


def resolved_length(tokens: list[int]) -> int:
    """The number of tokens on the host (a trailing placeholder excluded)."""
    return len(tokens) - 1 if tokens and tokens[-1] == PLACEHOLDER_TOKEN else len(tokens)


class DraftPool:
    """The sequences of one prompt (within one client and one adapter) and the index of their `KEY`-token windows."""

    def __init__(self, prompt_length: int):
        """
        Args:
            prompt_length: the prompt's tokens, at the start of every sequence (indexed once, in the first).
        """
        self.prompt_length = prompt_length
        self.sequences: list[list[int]] = []
        self._indexed: list[int] = []  # per sequence: its windows ending before this position are indexed
        # The sequences `catch_up` visits (in order): running samples', and finished ones' not indexed to their end yet
        # (True).
        self._growing: dict[int, bool] = {}
        # (window of KEY tokens) -> (sequence, position of the window's last token), in indexing order
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    @property
    def num_tokens(self) -> int:
        """Tokens the pool's sequences hold (what the drafter's memory bound counts)."""
        return sum(len(tokens) for tokens in self.sequences)

    def add(self, tokens: list[int]) -> int:
        """Take in a sample's token list (prompt first; not copied: it keeps growing); returns its number."""
        # The prompt's windows are indexed once, from the first sequence; the others from their first output token
        # (the window that ends there still reaches back into the prompt).
        first = KEY - 1 if not self.sequences else max(KEY - 1, self.prompt_length)
        self.sequences.append(tokens)
        self._indexed.append(first)
        self._growing[len(self.sequences) - 1] = False
        return len(self.sequences) - 1

    def finish(self, sequence: int) -> None:
        """A sequence's sample finished: the next `catch_up` indexes the rest of it, and passes it by from then on
        (nothing is indexed here: a pool no one drafts from is never indexed)."""
        if sequence in self._growing:
            self._growing[sequence] = True

    def propose(self, sequence: int, limit: int) -> tuple[tuple[int, ...], int]:
        """Up to `limit` tokens to follow `sequence`'s resolved tokens: the continuation of the longest earlier
        matches of its last tokens (at least `KEY`) elsewhere in the pool or earlier in itself. Where several
        matches are that long, each next token is the one most of them continue with, and the draft stops where
        fewer than half of them agree.

        Args:
            sequence: the asking sample's number (`add`).
            limit: the most tokens to propose.
        Returns:
            (the draft, the length of the match it follows; 0 with no draft). The index is as of the last
            `catch_up()`.
        """
        query = self.sequences[sequence]
        end = resolved_length(query)
        if end < KEY or limit < 1:
            return (), 0
        occurrences = self._index.get(tuple(query[end - KEY : end]), ())
        longest = min(MAX_MATCH, end)
        best_match, followed = 0, []  # the longest match, and the continuations of each match of that length
        for other, position in reversed(occurrences[-CANDIDATES:]):
            tokens = self.sequences[other]
            available = resolved_length(tokens)
            if available - position - 1 < 1 or (other == sequence and position == end - 1):
                continue
            match = _match_length(tokens, position + 1, query, end, min(longest, position + 1))
            if match > best_match:
                best_match, followed = match, []
            if match == best_match:
                followed.append(tokens[position + 1 : min(available, position + 1 + limit)])
        draft = _agreed_continuation(followed, limit)
        return draft, best_match if draft else 0

    def catch_up(self) -> None:
        """Index the running samples' sequences up to their resolved ends (the drafter does it once per step and
        pool; a finished sample's sequence was indexed whole when it finished)."""
        done = []
        for number, finished in self._growing.items():
            self._index_tail(number)
            if finished:
                done.append(number)
        for number in done:
            del self._growing[number]

    def _index_tail(self, number: int) -> None:
        """Index one sequence's windows from where its indexing stopped to its resolved end."""
        tokens, index = self.sequences[number], self._index
        first, end = self._indexed[number], resolved_length(tokens)
        if first >= end:
            return
        # The windows ending at first .. end - 1, made by zip in C (KEY == 2: a token and the one before it).
        windows = zip(tokens[first - 1 : end - 1], tokens[first:end])
        for position, window in enumerate(windows, first):
            found = index.get(window)
            if found is None:
                index[window] = [(number, position)]
            else:
                found.append((number, position))
        self._indexed[number] = end


def _match_length(tokens: list[int], stop: int, query: list[int], end: int, most: int) -> int:
    """How many tokens before `stop` in `tokens` equal those before `end` in `query`, counted back from there (at
    least `KEY`: the index key matched; at most `most`). Compared as slices, in C: a match is often the whole
    `MAX_MATCH` (siblings of one prompt agree for long stretches), then one comparison says so."""
    if tokens[stop - most : stop] == query[end - most : end]:
        return most
    low, high = KEY, most - 1  # tokens of the match: low are known equal, most are not
    while low < high:
        middle = (low + high + 1) // 2
        if tokens[stop - middle : stop] == query[end - middle : end]:
            low = middle
        else:
            high = middle - 1
    return low


def _agreed_continuation(followed: list[list[int]], limit: int) -> tuple[int, ...]:
    """Token by token, what most of the continuations agree on, while at least half of those still followed agree;
    the others are dropped at their first disagreement (or when they end)."""
    draft: list[int] = []
    for index in range(limit):
        if not followed:
            break
        votes: dict[int, int] = {}
        for continuation in followed:
            if index < len(continuation):
                votes[continuation[index]] = votes.get(continuation[index], 0) + 1
        if not votes:
            break
        token, count = max(votes.items(), key=lambda item: item[1])
        if 2 * count < len(followed):
            break
        draft.append(token)
        followed = [continuation for continuation in followed
                    if index < len(continuation) and continuation[index] == token]  # fmt: skip
    return tuple(draft)
