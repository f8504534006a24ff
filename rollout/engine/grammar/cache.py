"""The compiled grammars of one tokenizer, least recently used evicted past a byte budget.

Rollout keeps its own cache rather than xgrammar's: a grammar compiled elsewhere (the worker's compile slots, which
first prove a spec compiles within its budget in a child process) must be found by the engine's own compile of the
same spec, and each entry carries what the admission checks found (grammar_checks.py), so a repeated spec is
neither compiled nor checked twice.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

MAX_VERDICTS = 16  # min_new_tokens checks kept per grammar (by min_new_tokens and stop tokens)


@dataclass
class CheckedGrammar:
    """A compiled grammar and what its admission checks said."""

    compiled: Any  # xgrammar.CompiledGrammar
    first_step: str | None  # why it allows no token at the first step (None: it allows some)
    # (min_new_tokens, stop tokens) -> why no path reaches it (None: one does, or the check could not tell)
    verdicts: dict[tuple[int, frozenset[int]], str | None] = field(default_factory=dict)

    def remember(self, key: tuple[int, frozenset[int]], verdict: str | None) -> None:
        """Keep a min_new_tokens verdict (the oldest dropped past MAX_VERDICTS)."""
        if len(self.verdicts) >= MAX_VERDICTS:
            self.verdicts.pop(next(iter(self.verdicts)))
        self.verdicts[key] = verdict


class GrammarCache:
    """(kind, spec) -> CheckedGrammar, at most `limit_bytes` of compiled grammars (by xgrammar's own measure)."""

    def __init__(self, limit_bytes: int):
        """
        Args:
            limit_bytes: the most bytes of compiled grammars kept; the least recently used go first.
        """
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[tuple[str, Any], tuple[CheckedGrammar, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # compile slots, callers' threads and the serving thread share it

    def get(self, key: tuple[str, Any]) -> CheckedGrammar | None:
        """The entry of `key` (now the most recently used), or None."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
            return hit[0]

    def put(self, key: tuple[str, Any], entry: CheckedGrammar) -> CheckedGrammar:
        """Keep `entry` under `key` (an entry already there wins: two compiles of one spec share one grammar).

        Returns:
            The entry kept.
        """
        size = max(1, int(entry.compiled.memory_size_bytes)) + _key_bytes(key)  # a 64 KiB spec counts too
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0]
            self._entries[key] = (entry, size)
            self._bytes += size
            while self._bytes > self.limit_bytes and len(self._entries) > 1:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
            return entry

    @property
    def num_bytes(self) -> int:
        """Bytes of compiled grammars (and their specs) kept."""
        return self._bytes


def _key_bytes(key: tuple[str, Any]) -> int:
    """About what a cache key holds: its spec's characters (a choice's, all together)."""
    spec = key[1]
    if isinstance(spec, str):
        return len(spec)
    if isinstance(spec, tuple):
        return sum(len(choice) for choice in spec)
    return 0
