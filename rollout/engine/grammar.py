"""Structured outputs on xgrammar (vLLM's and SGLang's default grammar engine): a request's constraint compiled once
per (kind, spec, tokenizer), and a matcher per sample that masks its logits row and follows its tokens.

xgrammar is an optional dependency (`pip install rollout[structured]`): without it a constrained request is refused
by name."""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from rollout.validation import FieldError

try:
    import xgrammar
except ImportError:  # the extra is not installed: constraints are refused (Grammars.compile)
    xgrammar = None


ANY_OBJECT = json.dumps({"type": "object"})
# Compiled grammars kept per tokenizer (xgrammar evicts the least recently used beyond it): a client sending endless
# distinct specs cannot grow the worker's memory without bound. vLLM's default (VLLM_XGRAMMAR_CACHE_MB).
CACHE_LIMIT_BYTES = 512 << 20


class Grammars:
    """A grammar compiler per tokenizer, each with xgrammar's own cache of compiled grammars (by kind and spec)."""

    def __init__(self) -> None:
        self._compilers: dict[tuple[int, int], tuple[Any, Any]] = {}  # (id(tokenizer), vocab) -> (tokenizer, compiler)
        self._lock = threading.Lock()  # requests are prepared on callers' threads

    def compile(self, tokenizer: Any, vocab_size: int, field: str, spec: Any) -> Any:
        """The compiled grammar of constraint `field` = `spec` for this tokenizer and model vocabulary.

        Args:
            tokenizer: the model's Hugging Face tokenizer.
            vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
            field: "regex", "json", "choice", "grammar" or "json_object".
            spec: the field's (normalized) value.
        Raises:
            FieldError: xgrammar missing, no tokenizer, or a spec that does not compile (xgrammar's message quoted).
        """
        if xgrammar is None:
            raise FieldError(field, "structured outputs need xgrammar: pip install 'rollout[structured]'")
        if tokenizer is None:
            reason = "structured outputs need the model's tokenizer: pass tokenizer= to generate_batch / "
            raise FieldError(field, reason + "init_continuous_batching, or serve a model with one")
        compiler = self._compiler(tokenizer, vocab_size)
        try:
            if field == "regex":
                return compiler.compile_regex(spec)
            if field == "json":
                return compiler.compile_json_schema(spec)
            if field == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
            if field == "grammar":
                return compiler.compile_grammar(spec)
            return compiler.compile_json_schema(ANY_OBJECT)  # OpenAI's json_object: a JSON object
        except Exception as error:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError for a bad spec
            raise FieldError(field, f"does not compile: {str(error).strip()[:500]}") from None

    def _compiler(self, tokenizer: Any, vocab_size: int) -> Any:
        key = (id(tokenizer), vocab_size)
        with self._lock:
            entry = self._compilers.get(key)
            if entry is None or entry[0] is not tokenizer:
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
                compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=CACHE_LIMIT_BYTES)
                entry = (tokenizer, compiler)  # the tokenizer kept: its id stays unique
                self._compilers[key] = entry
            return entry[1]


class Constrained:
    """One sample's grammar state: the matcher fed every token the sample drew."""

    def __init__(self, field: str, compiled: Any):
        self.field = field
        self.compiled = compiled
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.rejected: int | None = None  # a token the grammar refused (the sample then ends with an error)

    def restarted(self) -> Constrained:
        """A fresh state on the same grammar (a fork of the group, before its first token)."""
        return Constrained(self.field, self.compiled)

    def accept(self, token_id: int) -> None:
        """Advance past a drawn token; a refused one is kept in `rejected`."""
        if not self.matcher.accept_token(token_id):
            self.rejected = token_id

    @property
    def terminated(self) -> bool:
        """The grammar is complete and accepted its end: nothing more may follow."""
        return self.matcher.is_terminated()


def mask_rows(scores: torch.Tensor, states: list[Constrained | None]) -> None:
    """Set to -inf, in place, every token the row's grammar does not allow next (rows without one are untouched).

    Args:
        scores: (rows, vocab) logits being processed.
        states: each row's grammar state, or None.
    """
    rows = [i for i, state in enumerate(states) if state is not None]
    bitmask = xgrammar.allocate_token_bitmask(len(rows), scores.shape[-1])
    for slot, row in enumerate(rows):
        states[row].matcher.fill_next_token_bitmask(bitmask, slot)
    indices = torch.tensor(rows, dtype=torch.long, device=scores.device)
    selected = scores.index_select(0, indices)
    xgrammar.apply_token_bitmask_inplace(selected, bitmask.to(scores.device))
    scores.index_copy_(0, indices, selected)
