"""The bans of the sampling pipeline (`Sampler`) for all of a step's rows at once, from the per-slot tables of
`rollout.engine.sampling.slot_state`: bans (no_repeat_ngram_size, bad_words_ids, suppress_tokens, begin_suppress_tokens,
in transformers' semantics) and min_new_tokens.

Every banned token of every row becomes one column index (the vocabulary size where a row bans nothing there: a
column past the logits), all of them are scattered into one (rows, vocab + 1) mask, and the mask sets the scores to
-inf: a fixed number of kernels per step whatever the number of rows, banned tokens or words, and no host read.
"""

from __future__ import annotations

import torch

from rollout.engine.sampling.slot_columns import SlotColumns
from rollout.engine.sampling.slot_state import SlotState

_NEG_INF = float("-inf")
_BEFORE_START = -2  # stands for the positions before a sample's first token: equal to no token, nor to -1 ("any")


def mask_bans(scores: torch.Tensor, state: SlotState, columns: SlotColumns) -> None:
    """Set every row's banned tokens to -inf, in place.

    Args:
        scores: (rows, vocab) fp32 scores after the penalties.
        state: the slot tables.
        columns: the rows' slots, positions (each row's length before the token it samples, counted on the host:
            exact while the newest token is still on the device) and sampling parameters.
    """
    vocab = state.vocab_size
    slots = columns.slots
    parts: list[torch.Tensor] = []
    outputs = None
    for name, table in state.lists.items():
        if table is None:
            continue
        ids = table.index_select(0, slots)
        if name != "always" and outputs is None:
            outputs = (columns.positions - columns.int("prompt_tokens")).unsqueeze(1)  # tokens generated so far
        if name == "first":  # begin_suppress_tokens: only while nothing was generated
            ids = torch.where(outputs == 0, ids, vocab)
        elif name == "stops":  # min_new_tokens: stop tokens while fewer were generated
            ids = torch.where(outputs < columns.int("min_new_tokens").unsqueeze(1), ids, vocab)
        parts.append(ids)
    if state.history is not None:
        parts += _history_bans(state, slots, columns.positions, columns.max_position, columns.int("ngram"))
    if not parts:
        return
    index = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    banned = torch.zeros(scores.shape[0], vocab + 1, dtype=torch.bool, device=scores.device)
    banned.scatter_(1, index, True)
    scores.masked_fill_(banned[:, :vocab], _NEG_INF)


def _history_bans(
    state: SlotState,
    slots: torch.Tensor,
    positions: torch.Tensor,
    max_position: int,
    ngram: torch.Tensor,
) -> list[torch.Tensor]:
    """The tokens no_repeat_ngram_size and multi-token bad words ban, per row, from the token history table.

    Row r with n = ngram[r] and length l bans the token at every position e in [n - 1, l) whose n - 1 predecessors
    equal the row's last n - 1 tokens: the n-gram ending at e would repeat (transformers' NoRepeatNGram). A bad word
    whose prefix (its tokens but the last) ends the row's tokens bans its last token (transformers' NoBadWords).
    """
    history = state.history
    length = min(max_position, history.shape[1] - 1)
    # Rows that keep no history (ngram 0, no words) may be longer than the table: their columns are never used.
    lengths = positions.clamp(max=length).unsqueeze(1)
    window = state.max_ngram()
    words = state.word_prefixes.shape[2] if state.word_prefixes is not None else 0
    pad = max(window - 1, words)
    tokens = history[:, :length].index_select(0, slots)  # (rows, length)
    padded = torch.cat([tokens.new_full((tokens.shape[0], pad), _BEFORE_START), tokens], dim=1) if pad else tokens
    parts: list[torch.Tensor] = []
    if window:
        n = ngram.unsqueeze(1)
        # (rows, length): n-grams that end before the row's length, in rows that set n. An n-gram ending at e < n - 1
        # needs no check of its own: it reaches before the first token, whose stand-in matches no token of the row's
        # last n - 1 (those reach as far back only when e = l).
        ban = torch.arange(length, device=tokens.device) < torch.where(n > 0, lengths, 0)
        if window > 1:
            # windows[r, e, c]: the token at e - (window - 1) + c; the last n - 1 tokens: at l - (window - 1) + c.
            start = pad - (window - 1)
            windows = padded[:, start:].unfold(1, window, 1)[:, :, :-1]
            columns = torch.arange(start, pad, device=tokens.device)  # padded columns of positions l - (window - 1)...
            same = windows == padded.gather(1, lengths + columns).unsqueeze(1)
            if len(state.ngrams) > 1:  # only the last n - 1 of the window - 1 columns count for a row with n < window
                same |= (columns < start + window - n).unsqueeze(1)
            ban &= same.all(dim=2)
        parts.append(torch.where(ban, tokens, state.vocab_size))
    if words:
        prefixes = state.word_prefixes.index_select(0, slots)  # (rows, words, k), right-aligned
        recent = padded.gather(1, lengths + torch.arange(pad - words, pad, device=tokens.device))  # tokens l - k...
        matches = ((prefixes == recent.unsqueeze(1)) | (prefixes < 0)).all(dim=2)
        parts.append(torch.where(matches, state.word_lasts.index_select(0, slots), state.vocab_size))
    return parts
