"""The running samples' token-dependent sampling state in per-slot device tables.

A slot's rows, written at its sample's first draw (when all its tokens are on the host) in one copy for all of a
step's new samples, and kept through preemption and recompute with the slot:

  seen      (slots, vocab) bool   tokens in the prompt or output (repetition_penalty)
  counts    (slots, vocab) fp32   times each token was generated (presence_penalty, frequency_penalty)
  history   (slots, width) int64  the tokens so far (no_repeat_ngram_size, multi-token bad words); the last column
                                  takes the writes of rows whose tokens do not fit (samples that keep no history)
  always / first / stops          (slots, width) int64 token lists padded with the vocabulary size: tokens never
                                  generated, not generated first (begin_suppress_tokens), masked until
                                  min_new_tokens (stop tokens)
  words     (slots, words, k) int64 multi-token bad words' prefixes, right-aligned, padded with -1 ("any token"),
            and (slots, words) their last tokens, padded with the vocabulary size

After each draw one scatter per table records the drawn tokens for every row, so nothing waits for them to reach
the host (with overlapped scheduling the next step is queued before they do). A row whose sample keeps no such state
writes into its own unused row, which its slot's next owner overwrites. A table exists only while some live sample
uses it; a new sample's list rows are written whenever the table exists (padding for a sample that uses none), so a
slot's previous owner leaves nothing behind. The ban masks (`rollout.engine.sampling.ban_masks`) read these tables for
all of a step's rows in a handful of kernels, whatever the number of rows.
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch

from rollout.engine.kv.transfer import to_device
from rollout.engine.requests.bans import always_banned
from rollout.engine.requests.request import Request
from rollout.engine.sampling.ban_lists import has_history, multi_token_words
from rollout.engine.sampling.slot_columns import SlotColumns

LISTS = ("always", "first", "stops")  # token-list tables, in the order the ban mask reads them


def penalized(request: Request) -> bool:
    """Whether the request's penalties read its tokens (repetition, presence or frequency penalty)."""
    params = request.sampling
    return params.repetition_penalty != 1 or bool(params.presence_penalty) or bool(params.frequency_penalty)


def _lists(request: Request) -> dict[str, list[int]]:
    """The request's token lists (see the module docstring)."""
    params = request.sampling
    stops = sorted(request.stop_token_ids) if params.min_new_tokens else []
    return {"always": always_banned(request), "first": sorted(set(params.begin_suppress_tokens)), "stops": stops}


def _uses(request: Request, lists: dict[str, list[int]]) -> list[str]:
    """The tables a request's processors read."""
    used = [name for name in LISTS if lists[name]]
    if penalized(request):
        used.append("penalties")
    if has_history(request.sampling):
        used.append("history")
    if multi_token_words(request.sampling):
        used.append("words")
    return used


class SlotState:
    """Per-slot device tables of the running samples' token-dependent state (see the module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int):
        """
        Args:
            vocab_size: the logits' width (also the padding of the token lists: a column past the logits).
            device: where the tables live.
            capacity: slots the tables hold (as many as `SamplingSlots`'; `grow` follows it).
        """
        self.vocab_size = vocab_size
        self.device = device
        self.capacity = capacity
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.history: torch.Tensor | None = None
        self.lists: dict[str, torch.Tensor | None] = dict.fromkeys(LISTS)
        self.word_prefixes: torch.Tensor | None = None
        self.word_lasts: torch.Tensor | None = None
        self.users: Counter[str] = Counter()  # table -> live slots that use it
        self.ngrams: Counter[int] = Counter()  # no_repeat_ngram_size of the live slots that set one
        self._registered: dict[int, tuple[list[str], int]] = {}  # slot -> (its tables, its n-gram size)
        self._true = torch.ones((), dtype=torch.bool, device=device)

    def max_ngram(self) -> int:
        """The largest no_repeat_ngram_size of a live slot (0 when none sets one)."""
        return max(self.ngrams) if self.ngrams else 0

    def assign(self, requests: list[Request]) -> None:
        """Write the rows of samples at their first draw (their slots just taken).

        Args:
            requests: the samples, each holding its slot, with all their tokens on the host.
        """
        lists = [_lists(request) for request in requests]
        uses = [_uses(request, entry) for request, entry in zip(requests, lists)]
        for request, used in zip(requests, uses):
            ngram = request.sampling.no_repeat_ngram_size
            self._registered[request.sampling_slot] = (used, ngram)
            self.users.update(used)
            if ngram:
                self.ngrams[ngram] += 1
        tokens_needed = [r for r, used in zip(requests, uses) if "penalties" in used or "history" in used]
        if tokens_needed:
            self._fill_tokens(tokens_needed)
        index = None
        for name in LISTS:
            if self.users[name] and self.lists[name] is None:
                self.lists[name] = torch.full((self.capacity, 1), self.vocab_size, dtype=torch.long, device=self.device)
            table = self.lists[name]
            if table is not None:
                rows = [entry[name] for entry in lists]
                table = self.lists[name] = _widened(table, max(map(len, rows)), self.vocab_size)
                padded = [row + [self.vocab_size] * (table.shape[1] - len(row)) for row in rows]
                index = index if index is not None else self._slots(requests)
                table.index_copy_(0, index, to_device(padded, torch.long, self.device))
        if self.users["words"] or self.word_prefixes is not None:
            self._write_words(requests, index if index is not None else self._slots(requests))

    def release(self, slot: int) -> None:
        """Forget a finished sample's slot; a table that no live sample uses any more is freed."""
        used, ngram = self._registered.pop(slot, ((), 0))
        self.users.subtract(used)
        if ngram:
            self.ngrams[ngram] -= 1
            if not self.ngrams[ngram]:
                del self.ngrams[ngram]
        if not self.users["penalties"]:
            self.seen = self.counts = None
        if not self.users["history"]:
            self.history = None
        for name in LISTS:
            if not self.users[name]:
                self.lists[name] = None
        if not self.users["words"]:
            self.word_prefixes = self.word_lasts = None

    def grow(self, capacity: int) -> None:
        """Give the tables `capacity` rows (stream-ordered copies: steps already queued read the old ones)."""
        extra = capacity - self.capacity
        self.capacity = capacity

        def grown(table: torch.Tensor | None, fill: int | bool) -> torch.Tensor | None:
            if table is None:
                return None
            return torch.cat([table, table.new_full((extra, *table.shape[1:]), fill)])

        self.seen, self.counts, self.history = grown(self.seen, False), grown(self.counts, 0), grown(self.history, 0)
        self.lists = {name: grown(table, self.vocab_size) for name, table in self.lists.items()}
        self.word_prefixes, self.word_lasts = grown(self.word_prefixes, -1), grown(self.word_lasts, self.vocab_size)

    def penalize(self, scores: torch.Tensor, columns: SlotColumns) -> torch.Tensor:
        """Step 1 for every row at once: repetition_penalty on seen tokens (transformers' semantics), presence and
        frequency penalties on generated ones (OpenAI's). A row without penalties holds neutral values (1, 0, 0)
        and comes out exactly as it went in.

        Args:
            scores: (rows, vocab) fp32 scores.
            columns: the rows' slots and sampling parameters.
        """
        if self.seen is None:
            return scores
        seen, counts = self.seen.index_select(0, columns.slots), self.counts.index_select(0, columns.slots)
        repetition = columns.float("repetition_penalty")
        scores = torch.where(seen, torch.where(scores < 0, scores * repetition, scores / repetition), scores)
        return scores - columns.float("presence_penalty") * (counts > 0) - columns.float("frequency_penalty") * counts

    def record(self, columns: SlotColumns, token_ids: torch.Tensor) -> None:
        """Record each row's drawn token on the device: one scatter per table, no host read.

        Args:
            columns: the rows' slots (distinct: a sample has one row per step) and positions (where each drawn
                token goes in its sample's tokens).
            token_ids: (rows,) the drawn tokens.
        """
        slots, positions = columns.slots, columns.positions
        if self.seen is not None:
            self.seen.index_put_((slots, token_ids), self._true)
            # index_add_ on the flattened table: accumulates, and never reads an index back to the host.
            flat = slots * self.vocab_size + token_ids
            self.counts.view(-1).index_add_(0, flat, torch.ones_like(token_ids, dtype=self.counts.dtype))
        if self.history is not None:
            dump = self.history.shape[1] - 1
            self.history.index_put_((slots, positions.clamp(max=dump)), token_ids)

    def _slots(self, requests: list[Request]) -> torch.Tensor:
        return to_device([request.sampling_slot for request in requests], torch.long, self.device)

    def _fill_tokens(self, requests: list[Request]) -> None:
        """Reset the penalty rows of new samples and fill them, and their history, from their tokens (one copy)."""
        for request in requests:
            if request.has_placeholder:
                raise RuntimeError(f"sampler state of {request.request_id} built before its last token was resolved")
        if self.users["penalties"] and self.seen is None:
            self.seen = torch.zeros(self.capacity, self.vocab_size, dtype=torch.bool, device=self.device)
            self.counts = torch.zeros(self.capacity, self.vocab_size, dtype=torch.float32, device=self.device)
        if self.users["history"]:
            longest = max(
                (r.num_prompt_tokens + r.max_new_tokens for r in requests if has_history(r.sampling)), default=0
            )
            if self.history is None or self.history.shape[1] <= longest:
                width = longest + 1 if self.history is None else max(longest + 1, 2 * self.history.shape[1])
                self.history = _widened(self.history, width, 0, self.capacity, self.device)
        slots = [request.sampling_slot for request in requests]
        rows = list(itertools.chain.from_iterable([s] * r.num_tokens for s, r in zip(slots, requests)))
        positions = list(itertools.chain.from_iterable(range(r.num_tokens) for r in requests))
        tokens = list(itertools.chain.from_iterable(r.token_ids for r in requests))
        rows_t, positions_t, tokens_t = to_device([rows, positions, tokens], torch.long, self.device)
        if self.seen is not None:
            index = to_device(slots, torch.long, self.device)
            self.seen.index_fill_(0, index, False)
            self.counts.index_fill_(0, index, 0.0)
            self.seen.index_put_((rows_t, tokens_t), self._true)
            if any(request.num_output_tokens for request in requests):  # a first draw normally has no output yet
                outputs = [(s, t) for s, r in zip(slots, requests) for t in r.output_ids]
                flat = to_device([s * self.vocab_size + t for s, t in outputs], torch.long, self.device)
                self.counts.view(-1).index_add_(0, flat, torch.ones(len(outputs), device=self.device))
        if self.history is not None:
            dump = self.history.shape[1] - 1
            self.history.index_put_((rows_t, positions_t.clamp(max=dump)), tokens_t)

    def _write_words(self, requests: list[Request], index: torch.Tensor) -> None:
        """Write new samples' multi-token bad words (padding for samples without any), widening the tables. Rows
        are built once per distinct sampling settings (a group's samples share theirs), then repeated on the device:
        n = 1024 samples of 1024 words would otherwise build a 32M-item nested list, holding the GIL for seconds."""
        distinct: dict[int, int] = {}  # id(sampling) -> its row among the distinct ones
        samplings = [distinct.setdefault(id(request.sampling), len(distinct)) for request in requests]
        owners = {row: request.sampling for request, row in zip(requests, samplings)}
        words = [multi_token_words(owners[row]) for row in range(len(distinct))]
        count = max([len(w) for w in words] + [1])
        length = max([len(word) - 1 for w in words for word in w] + [1])
        if self.word_prefixes is None:
            self.word_prefixes = torch.full((self.capacity, count, length), -1, dtype=torch.long, device=self.device)
            self.word_lasts = torch.full((self.capacity, count), self.vocab_size, dtype=torch.long, device=self.device)
        old_count, old_length = self.word_lasts.shape[1], self.word_prefixes.shape[2]
        count, length = max(count, old_count), max(length, old_length)
        if length > old_length:  # prefixes are right-aligned: new columns go on the left, as "any token"
            pad = self.word_prefixes.new_full((self.capacity, old_count, length - old_length), -1)
            self.word_prefixes = torch.cat([pad, self.word_prefixes], 2)
        if count > old_count:
            pad = self.word_prefixes.new_full((self.capacity, count - old_count, length), -1)
            self.word_prefixes = torch.cat([self.word_prefixes, pad], 1)
            self.word_lasts = _widened(self.word_lasts, count, self.vocab_size)
        prefixes = [
            [[-1] * (length + 1 - len(word)) + list(word[:-1]) for word in w] + [[-1] * length] * (count - len(w))
            for w in words
        ]
        lasts = [[word[-1] for word in w] + [self.vocab_size] * (count - len(w)) for w in words]
        repeat = to_device(samplings, torch.long, self.device)  # each sample's row among the distinct ones
        self.word_prefixes.index_copy_(0, index, to_device(prefixes, torch.long, self.device)[repeat])
        self.word_lasts.index_copy_(0, index, to_device(lasts, torch.long, self.device)[repeat])


def _widened(
    table: torch.Tensor | None,
    width: int,
    fill: int,
    rows: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """`table` with at least `width` columns, new ones holding `fill` (a new table of `rows` rows when None)."""
    if table is None:
        return torch.full((rows, width), fill, dtype=torch.long, device=device)
    if table.shape[1] >= width:
        return table
    return torch.cat([table, table.new_full((table.shape[0], width - table.shape[1]), fill)], 1)
