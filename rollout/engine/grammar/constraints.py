"""Structured outputs on xgrammar (vLLM's and SGLang's default grammar engine): a request's constraint compiled once
per (kind, spec, tokenizer) and checked for admission (grammar_checks.py), and a matcher per sample that masks its
logits row and follows its tokens.

xgrammar is an optional dependency (`pip install rollout[structured]`): without it a constrained request is refused
by name."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import numpy as np
import torch

from rollout.engine.grammar.cache import CheckedGrammar, GrammarCache
from rollout.engine.grammar.checks import allowed_tokens, first_step_refusal, too_short_refusal
from rollout.engine.grammar.cpu_bounds import MAX_LOOK_AHEAD_S, CpuWatch
from rollout.engine.grammar.length_goal import MAX_ROW_FILLS, LengthGoal, prune_short_paths
from rollout.engine.grammar.vocabulary import grammar_tokenizer_info
from rollout.validation import FieldError

try:
    import xgrammar
except ImportError:  # the extra is not installed: constraints are refused (Grammars.compile)
    xgrammar = None


ANY_OBJECT = json.dumps({"type": "object"})
# Compiled grammars kept per tokenizer (the least recently used evicted beyond it): a client sending endless
# distinct specs cannot grow the worker's memory without bound. vLLM's default (VLLM_XGRAMMAR_CACHE_MB).
CACHE_LIMIT_BYTES = 512 << 20


def compile_spec(compiler: Any, field: str, spec: Any) -> Any:
    """Compile constraint `field` = `spec` with an xgrammar GrammarCompiler (xgrammar's exceptions pass through).

    Args:
        compiler: an xgrammar GrammarCompiler.
        field: "regex", "json", "choice", "grammar" or "json_object".
        spec: the field's (normalized) value.
    """
    if field == "regex":
        return compiler.compile_regex(spec)
    if field == "json":
        return compiler.compile_json_schema(spec)
    if field == "choice":
        # (ensure_ascii=False: an escaped character above U+FFFF would be two surrogates to xgrammar)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec))
    if field == "grammar":
        return compiler.compile_grammar(spec)
    return compiler.compile_json_schema(ANY_OBJECT)  # OpenAI's json_object: a JSON object


# xgrammar's C++ errors start with its log prefix: "[11:23:52] /project/cpp/json_schema_converter.cc:5082: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def compile_error_message(error: BaseException) -> str:
    """What a spec that does not compile is answered with: xgrammar's message without its log prefix (the time, its
    source file and line), at most 500 characters.

    Args:
        error: what `compile_spec` raised.
    """
    return _LOG_PREFIX.sub("", str(error).strip())[:500]


class _TokenizerGrammars:
    """One tokenizer's xgrammar preparation, compiler and cache of checked grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer  # kept: its id stays unique while this entry lives
        self.info = grammar_tokenizer_info(tokenizer, vocab_size)  # its special tokens never match text
        # xgrammar's own cache is off: the cache below holds what any compile made, checks included.
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.cache = GrammarCache(CACHE_LIMIT_BYTES)
        self._order: np.ndarray | None = None

    @property
    def order(self) -> np.ndarray:
        """Every token id, shortest decoded first (the min_new_tokens check's order), computed once."""
        if self._order is None:
            lengths = np.zeros(self.info.vocab_size, dtype=np.int64)
            decoded = self.info.decoded_vocab
            lengths[: len(decoded)] = [len(token) for token in decoded]
            self._order = np.argsort(lengths, kind="stable")
        return self._order


class Grammars:
    """A grammar compiler per tokenizer, each with a cache of checked compiled grammars (by kind and spec)."""

    def __init__(self) -> None:
        self._compilers: dict[tuple[int, int], _TokenizerGrammars] = {}  # (id(tokenizer), vocab) -> its grammars
        self._lock = threading.Lock()  # requests are prepared on callers' threads

    def compile(
        self,
        tokenizer: Any,
        vocab_size: int,
        field: str,
        spec: Any,
        min_tokens: int = 0,
        stop_token_ids: frozenset[int] = frozenset(),
    ) -> Any:
        """The compiled grammar of constraint `field` = `spec` for this tokenizer and model vocabulary (compiled
        once: later calls find it in the cache), checked that a request can follow it.

        Args:
            tokenizer: the model's Hugging Face tokenizer.
            vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
            field: "regex", "json", "choice", "grammar" or "json_object".
            spec: the field's (normalized) value.
            min_tokens: the request's min_new_tokens (its stop tokens masked until then).
            stop_token_ids: the request's stop tokens.
        Raises:
            FieldError: naming `field`: xgrammar missing, no tokenizer, a spec that does not compile (xgrammar's
                message quoted), one that allows no token at the first step, or one whose every output ends before
                min_tokens.
        """
        grammars = self._grammars(field, tokenizer, vocab_size)
        entry = grammars.cache.get((field, spec))
        if entry is None:
            try:
                compiled = compile_spec(grammars.compiler, field, spec)
            except Exception as error:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError for a bad spec
                raise FieldError(field, f"does not compile: {compile_error_message(error)}") from None
            entry = grammars.cache.put((field, spec), CheckedGrammar(compiled, first_step_refusal(compiled)))
        if entry.first_step is not None:
            raise FieldError(field, entry.first_step)
        if min_tokens > 0:
            key = (min_tokens, frozenset(stop_token_ids))
            if key not in entry.verdicts:
                entry.remember(key, too_short_refusal(entry.compiled, min_tokens, key[1], grammars.order))
            if entry.verdicts[key] is not None:
                raise FieldError(field, entry.verdicts[key])
        return entry.compiled

    def length_goal(self, tokenizer: Any, vocab_size: int, min_tokens: int, ends: frozenset[int]) -> LengthGoal:
        """What a constrained sample of this tokenizer must reach before `ends` may come (`Constrained.goal`).

        Args:
            tokenizer, vocab_size: as for `compile` (compiled with them first).
            min_tokens: the request's min_new_tokens.
            ends: the tokens masked until then (its stop tokens and the grammar's end tokens).
        """
        return LengthGoal.of(min_tokens, ends, self._grammars("grammar", tokenizer, vocab_size).order)

    def is_cached(self, tokenizer: Any, vocab_size: int, field: str, spec: Any) -> bool:
        """Whether `compile` of this spec finds it compiled (then it costs no compile, at most its checks). Never
        waits for a tokenizer's preparation (seconds on a large vocabulary, under the lock): a serving loop asks."""
        grammars = self._compilers.get((id(tokenizer), vocab_size))  # (one dict read: atomic without the lock)
        return (
            grammars is not None and grammars.tokenizer is tokenizer and grammars.cache.get((field, spec)) is not None
        )

    def adopt(self, tokenizer: Any, vocab_size: int, field: str, spec: Any, grammar_json: str) -> None:
        """Cache a grammar compiled elsewhere (a compile process of the worker) for this spec, checked as `compile`
        checks what it compiles: the engine's compile of the spec then finds it.

        Args:
            tokenizer, vocab_size, field, spec: as for `compile`.
            grammar_json: the compiled grammar as xgrammar's `serialize_json` wrote it, for this tokenizer.
        Raises:
            Exception: xgrammar's, when the JSON is not a grammar for this tokenizer (then compile it instead).
        """
        grammars = self._grammars(field, tokenizer, vocab_size)
        compiled = xgrammar.CompiledGrammar.deserialize_json(grammar_json, grammars.info)
        grammars.cache.put((field, spec), CheckedGrammar(compiled, first_step_refusal(compiled)))

    def tokenizer_info(self, tokenizer: Any, vocab_size: int) -> Any:
        """xgrammar's TokenizerInfo of this tokenizer and vocabulary (what compiles elsewhere must match).

        Raises:
            FieldError: naming "grammar" when xgrammar or the tokenizer is missing.
        """
        return self._grammars("grammar", tokenizer, vocab_size).info

    def clear(self) -> None:
        """Drop every compiler and its cache of compiled grammars (up to CACHE_LIMIT_BYTES each)."""
        with self._lock:
            self._compilers.clear()

    def _grammars(self, field: str, tokenizer: Any, vocab_size: int) -> _TokenizerGrammars:
        if xgrammar is None:
            raise FieldError(field, "structured outputs need xgrammar: pip install 'rollout[structured]'")
        if tokenizer is None:
            reason = "structured outputs need the model's tokenizer: pass tokenizer= to generate_batch / "
            raise FieldError(field, reason + "init_continuous_batching, or serve a model with one")
        key = (id(tokenizer), vocab_size)
        with self._lock:
            entry = self._compilers.get(key)
            if entry is None or entry.tokenizer is not tokenizer:
                entry = _TokenizerGrammars(tokenizer, vocab_size)
                self._compilers[key] = entry
            return entry


class Constrained:
    """One sample's grammar state: the matcher fed every token the sample drew."""

    def __init__(self, field: str, compiled: Any):
        self.field = field
        self.compiled = compiled
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.rejected: int | None = None  # a token the grammar refused (the sample then ends with an error)
        self.goal: LengthGoal | None = None  # min_new_tokens to reach before an end token: its masks look ahead
        self.generated = 0  # tokens the matcher advanced past (the sample's, in order)
        # Tokens advanced past before their step was resolved (`accept_ahead`); their `accept` is then a no-op.
        self.ahead = 0
        # Whether following it got too slow (`cpu_bounds.py`): such a state stays open, but its mask allows nothing
        # (`GrammarMasks.fill`), so its sample ends at its next step with `dead_end_reason`.
        self.watch = CpuWatch()

    def restarted(self) -> Constrained:
        """A fresh state on the same grammar (a fork of the group, before its first token)."""
        state = Constrained(self.field, self.compiled)
        state.goal = self.goal
        return state

    def accept(self, token_id: int) -> None:
        """Advance past a drawn token as its step is resolved (unless `accept_ahead` did already); a refused one is
        kept in `rejected`."""
        if self.ahead:
            self.ahead -= 1
            return
        self.advance(token_id)

    def accept_ahead(self, token_id: int) -> None:
        """Advance past a drawn token whose step is not resolved yet, so the next step's mask can be filled while
        that step's forward runs (the resolve's `accept` then skips it). Nothing once the state is closed."""
        if self.is_open:
            self.advance(token_id)
            self.ahead += 1

    def advance(self, token_id: int) -> None:
        """Feed a token to the matcher; a refused one is kept in `rejected`, its CPU time in `watch`."""
        start = time.thread_time()
        if not self.matcher.accept_token(token_id):
            self.rejected = token_id
        self.watch.accepted(time.thread_time() - start, self.generated)
        self.generated += 1

    def dead_end_reason(self) -> str:
        """Why the sample ends with an error when its row allows no token (its grammar's mask and its bans)."""
        if self.watch.too_slow is not None:
            return f"{self.field}: {self.watch.reason()}"
        reason = f"{self.field}: the grammar allows no token at this position"
        if self.spells_nothing():
            return reason + ": no token of this model's vocabulary spells what it accepts next"
        goal = self.goal
        if goal is not None and self.generated < goal.min_tokens:
            reason += (
                f": only its end or stop tokens, masked until min_tokens={goal.min_tokens} tokens came (after "
                f"{self.generated}, on a branch that ends sooner: see min_new_tokens in docs/guides/structured-outputs.md)"
            )
        else:  # its own mask allows a token: the request's own bans took every one
            reason += (
                " that the request's bans leave (bad_words_ids, suppress_tokens, begin_suppress_tokens, "
                "no_repeat_ngram_size, a logit_bias of -inf)"
            )
        return reason

    def spells_nothing(self) -> bool:
        """Whether the grammar, not complete, allows no token here by its own mask (before min_new_tokens and
        bans): what it accepts next starts with a character no token of the vocabulary writes (a regex `h(é)x`
        over a vocabulary without "é"), found only once a sample has come this far."""
        vocab_size = self.compiled.tokenizer_info.vocab_size
        if self.matcher.is_terminated():
            return False
        return not allowed_tokens(self.matcher, xgrammar.allocate_token_bitmask(1, vocab_size), vocab_size).size

    @property
    def is_open(self) -> bool:
        """More tokens may follow: the grammar is not complete and refused nothing."""
        return self.rejected is None and not self.matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        """The grammar is complete and accepted its end: nothing more may follow."""
        return self.matcher.is_terminated()


class GrammarMasks:
    """Applies constrained rows' grammars to a step's scores: xgrammar's batch matcher fills their token bitmasks on
    its threads (a row's mask is a walk of its grammar over the vocabulary), xgrammar's kernel sets the refused
    tokens to -inf on the scores' device. Unconstrained rows are not touched.

    The bitmask is filled in one host buffer (pinned when the scores are on a GPU, so its copy is queued, not
    waited for). Reusing it is safe: before a constrained step's masks are filled, the last step that copied the
    buffer has had its sampled tokens brought to the host (resolved, or fetched early by the engine's
    `_accept_ahead`), and that copy was queued before those tokens were.
    """

    def __init__(self) -> None:
        self._batch = None  # xgrammar.BatchGrammarMatcher, made at the first constrained step
        self._buffer: torch.Tensor | None = None

    def fill(self, states: list[Constrained | None], vocab_size: int, pinned: bool) -> tuple[torch.Tensor, list[int]]:
        """(the bitmask, the constrained rows): row i of the bitmask filled by states[i]'s grammar."""
        # A closed state (its grammar ended, or refused a token, at the step before) belongs to a sample that ends
        # when that step is resolved: its row here is dropped, so it is not masked.
        rows = [i for i, state in enumerate(states) if state is not None and state.is_open]
        # A row whose grammar got too slow to follow (`CpuWatch.too_slow`) is not filled: it allows nothing, so
        # its sample ends with an error at this step (`dead_end_reason`), and its cost stops here.
        slow = [row for row in rows if states[row].watch.too_slow is not None]
        filled = [row for row in rows if states[row].watch.too_slow is None] if slow else rows
        words = (vocab_size + 31) // 32
        buffer = self._buffer
        if buffer is None or buffer.shape[0] < len(states) or buffer.shape[1] != words or buffer.is_pinned() != pinned:
            buffer = torch.empty((max(len(states), 64), words), dtype=torch.int32, pin_memory=pinned)
            self._buffer = buffer
        if self._batch is None:
            self._batch = xgrammar.BatchGrammarMatcher()
        bitmask = buffer[: len(states)]
        if len(rows) < len(states):  # unconstrained rows allow every token: the kernel then needs no row list
            chosen = set(rows)
            free = [i for i in range(len(states)) if i not in chosen]
            bitmask.index_fill_(0, torch.tensor(free, dtype=torch.long), -1)
        if slow:
            bitmask.index_fill_(0, torch.tensor(slow, dtype=torch.long), 0)
        if filled:
            self._batch.batch_fill_next_token_bitmask([states[row].matcher for row in filled], bitmask, filled)
        words = None  # the bitmask as numpy uint32 rows (one view for all: no torch operator per row)
        for row in filled:  # short of min_new_tokens: no branch that ends sooner (length_goal.py)
            state = states[row]
            if state.goal is not None and state.generated < state.goal.min_tokens:
                words = bitmask.numpy().view(np.uint32) if words is None else words
                vocab = state.compiled.tokenizer_info.vocab_size
                start = time.thread_time()
                goal, generated = state.goal, state.generated
                prune_short_paths(state.matcher, vocab, goal, generated, words[row], MAX_ROW_FILLS, MAX_LOOK_AHEAD_S)
                state.watch.looked_ahead(time.thread_time() - start, generated)  # past its bound: ended next step
        return bitmask, rows

    def release(self) -> None:
        """Drop the bitmask buffer (pinned host memory on a GPU) and the batch matcher's threads."""
        self._buffer, self._batch = None, None

    def apply(self, scores: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set to -inf, in place, every token a constrained row's bitmask refuses (`rows`: the constrained ones;
        the others' bitmask rows allow everything, so every row goes through xgrammar's kernel, with no row list
        to copy to the device)."""
        on_device = bitmask.to(scores.device, non_blocking=True)
        if len(rows) * 4 < len(bitmask) and scores.device.type == "cpu":  # few rows: the CPU kernel takes a list
            xgrammar.apply_token_bitmask_inplace(scores, on_device, vocab_size=scores.shape[-1], indices=rows)
        else:
            xgrammar.apply_token_bitmask_inplace(scores, on_device, vocab_size=scores.shape[-1])

    def __call__(self, scores: torch.Tensor, states: list[Constrained | None]) -> None:
        """Mask `scores` (rows, vocab), in place, by each row's grammar state (None: the row is not constrained)."""
        bitmask, rows = self.fill(states, scores.shape[-1], scores.device.type == "cuda")
        self.apply(scores, bitmask, rows)
