"""`OutputText`: a completion's text, decoded a few tokens at a time as tokens arrive, and the stop strings found in
it. The engine uses it to end a request at a stop string; the HTTP front end uses the same class, fed the same tokens,
to build the text it returns and streams, so both always agree on where a completion stopped. Free of torch.

Decoding is incremental (the offsets algorithm of vLLM's detokenizer): each token decodes a window of the last few
tokens, never the whole completion, and text is released only once its characters are whole (a token that ends in the
middle of a UTF-8 character waits for the next). A stop string is found wherever it lies across token boundaries.

Which tokens a stopped completion returns: every token up to and including the one whose text completes the stop
string (the tokenizer may have merged the stop string's last characters with text after it into that token, so the
token ids are never cut inside a token; their log-probs are those of exactly these tokens). The text ends just before
the stop string, or just after it with `include_stop_str_in_output`, as in vLLM.

`TokenBytes`: the UTF-8 bytes of one token, as OpenAI's chat log-probs carry them (`bytes`), so that a client joins
the bytes of the tokens that split a character to read it back. A token that ends or starts inside a multi-byte
character decodes on its own to U+FFFD, whose bytes (EF BF BD) are not the token's: its bytes are read from the
vocabulary instead, for byte-level BPE tokenizers (GPT-2's alphabet: Qwen, Llama 3, ...) and SentencePiece
byte-fallback pieces (`<0xC3>`: Llama 2, Mistral, Gemma). Every other token's bytes are its text's.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Prompt tokens decoded ahead of the first output token, so that its text is what it reads after the prompt (a
# SentencePiece token's leading space, for one, depends on the token before it).
CONTEXT_TOKENS = 5
# Decoded text that ends in this character ends inside a multi-byte character: wait for the next token...
INCOMPLETE = "\ufffd"
# ...but for no more than this many tokens (a run of bytes that never completes a character is released as it is,
# so the decoded window, and the cost of a token, stay bounded).
MAX_PENDING_TOKENS = 8


class OutputText:
    """The text of one completion, fed one token at a time.

    Attributes:
        stopped: the stop string that ended the completion, or None.
        text: the text so far (cut at the stop string once one was found), released or not.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        """
        Args:
            tokenizer: a transformers tokenizer (anything with `decode(ids, skip_special_tokens=...)`).
            prompt_ids: the prompt (its last few tokens give the first output token its context).
            skip_special_tokens: leave special tokens out of the text (stop strings are matched in this text).
            stop: strings that end the completion where they first appear.
            include_stop_str_in_output: keep the stop string at the end of the text.
            min_tokens: stop strings count only in text that the tokens after the first `min_tokens` complete.
        """
        self._settings = (tokenizer, list(prompt_ids[-CONTEXT_TOKENS:]), skip_special_tokens, stop)
        self._settings += (include_stop_str_in_output, min_tokens)
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        # Characters that may still turn out to begin a stop string are held back from `add`'s released text.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0  # self._ids[prefix:read] was decoded already; its text is the base of the next
        self._read_offset = len(self._ids)
        self._early = 0  # characters of the tokens waiting to complete a character, returned already
        self._released = 0  # characters of `text` handed out by add() / finish()
        self.text = ""
        self.stopped: str | None = None

    def add(self, token_id: int) -> str:
        """Take one more token.

        Args:
            token_id: the next generated token.
        Returns:
            The text released by this token: new whole characters, less any that may begin a stop string (they
            follow once it is clear they do not); "" once stopped.
        """
        if self.stopped is not None:
            return ""
        self._num_tokens += 1
        new_text = self._decode_next(token_id)
        if not new_text:
            return ""
        before = len(self.text)
        self.text += new_text
        if not self._stop:
            return self._release(len(self.text))
        if self._num_tokens > self._min_tokens:
            self._find_stop(before)
            if self.stopped is not None:
                return self._release(len(self.text))
        # Held back even within min_tokens: what was released can never be taken back.
        return self._release(len(self.text) - self._hold)

    def restarted(self) -> OutputText:
        """A new `OutputText` with the same settings, fed nothing yet (for another sample of the same prompt)."""
        return OutputText(*self._settings)

    def finish(self) -> str:
        """The text still held back: characters that might have begun a stop string, and tokens that ended inside
        a character (decoded as they are). Call it once the completion ended without a stop string."""
        if self.stopped is None and len(self._ids) > self._read_offset:
            self.text += self._decode_next(None)
        return self._release(len(self.text))

    def _decode_next(self, token_id: int | None) -> str:
        """The new text of `token_id` (None: flush what waits), or "" while it ends inside a character."""
        ids = self._ids
        if token_id is not None:
            ids.append(token_id)
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(ids[self._prefix_offset :])
        pending = len(ids) - self._read_offset
        start = len(prefix_text) + self._early  # the waiting tokens' whole characters handed out already
        if token_id is not None and full_text.endswith(INCOMPLETE) and pending < MAX_PENDING_TOKENS:
            # The characters before the one still incomplete are whole: they count now (a stop string among them
            # ends the completion at this token, as `generate` ends it), not once the character completes.
            whole = full_text.rstrip(INCOMPLETE)
            early = whole[start:] if len(whole) > start else ""
            self._early += len(early)
            return early
        # The decoded window moves on, also past tokens without text (special tokens left out): tokens before the
        # new prefix are never decoded again, so a token costs the same however long the completion.
        del ids[: self._read_offset]
        self._prefix_offset, self._read_offset, self._early = 0, len(ids), 0
        return full_text[start:] if len(full_text) > start else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""

    def _find_stop(self, before: int) -> None:
        """Cut `text` at the stop string that the newest characters (from `before` on) complete first (of two that
        end at the same character, the longer)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            start = self.text.find(stop, max(0, before - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is not None:
            end, start, self.stopped = best
            self.text = self.text[: end if self._include_stop else start]

    def _release(self, upto: int) -> str:
        if upto <= self._released:
            return ""
        released, self._released = self.text[self._released : upto], upto
        return released


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read back: the character a byte-level BPE vocabulary writes for each byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1)]
    kept += range(ord("\u00ae"), ord("\u00ff") + 1)
    characters = {byte: byte for byte in kept}
    for byte in range(256):
        if byte not in characters:
            characters[byte] = 256 + len(characters) - len(kept)
    return {chr(character): byte for byte, character in characters.items()}


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def _decoder_types(tokenizer: Any) -> set[str]:
    """The types of a fast tokenizer's decoders ("ByteLevel", "ByteFallback", ...; none for any other tokenizer)."""
    try:
        state = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__())
    except Exception:  # noqa: BLE001 - a slow tokenizer, or one without a decoder: its tokens' bytes are their text's
        return set()
    found, pending = set(), [state]
    while pending:
        decoder = pending.pop()
        if isinstance(decoder, dict):
            found.add(decoder.get("type"))
            pending.extend(decoder.get("decoders") or ())
    return found


class TokenBytes:
    """The bytes of a tokenizer's tokens (`token_bytes(token_id, text)`, with `text` the token decoded alone)."""

    def __init__(self, tokenizer: Any):
        """
        Args:
            tokenizer: the served tokenizer.
        """
        self._tokenizer = tokenizer
        types = _decoder_types(tokenizer)
        self._byte_level = "ByteLevel" in types
        self._byte_fallback = "ByteFallback" in types
        self._added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())

    def __call__(self, token_id: int, text: str) -> list[int]:
        """The token's bytes: its text's, unless its text holds U+FFFD where its piece spells its own bytes."""
        if INCOMPLETE in text and (self._byte_level or self._byte_fallback) and token_id not in self._added:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and self._byte_fallback and _BYTE_PIECE.fullmatch(piece):
                return [int(piece[3:5], 16)]
            if isinstance(piece, str) and self._byte_level and piece and all(c in BYTE_LEVEL_ALPHABET for c in piece):
                return [BYTE_LEVEL_ALPHABET[c] for c in piece]
        return list(text.encode("utf-8"))
