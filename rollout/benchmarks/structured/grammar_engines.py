"""xgrammar (the engine rollout uses) against llguidance (vLLM's other grammar engine), on the bench tokenizer: the
tokenizer's preparation, a schema's compile, and the masks of a batch of rows walking the same JSON grammar, each
library filling its rows on its own threads. Run by `rollout-bench structured` when llguidance is installed
(`pip install llguidance`; not a dependency of rollout).

Both walk the same token sequences: each row draws, from what xgrammar allows, a token that both engines accept
(the step is then checked to give both the same allowed count, so the masks are the same work)."""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import Any

import torch


def available() -> bool:
    """Whether llguidance can be imported."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def compare(tokenizer: Any, schema: dict, rows: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """Milliseconds of each engine: tokenizer preparation, a compile, and the median mask fill of `rows` rows.

    Args:
        tokenizer: the Hugging Face tokenizer both engines read.
        schema: the JSON schema both compile.
        rows: rows masked per step (each its own matcher).
        steps: steps walked.
        seed: chooses each row's tokens.
    """
    import llguidance
    import llguidance.torch
    import xgrammar

    vocab = len(tokenizer)
    text = json.dumps(schema)
    figures: dict[str, Any] = {}
    start = time.perf_counter()
    xg_compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    figures["xgrammar_prepare_ms"] = (time.perf_counter() - start) * 1000
    start = time.perf_counter()
    ll_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_RawVocabulary(tokenizer)), n_vocab=vocab)
    figures["llguidance_prepare_ms"] = (time.perf_counter() - start) * 1000
    start = time.perf_counter()
    compiled = xg_compiler.compile_json_schema(text)
    figures["xgrammar_compile_ms"] = (time.perf_counter() - start) * 1000
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
    ll_matchers = [llguidance.LLMatcher(ll_tokenizer, grammar) for _ in range(rows)]
    figures["llguidance_compile_ms"] = (time.perf_counter() - start) * 1000
    xg_matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(rows)]
    batch, executor = xgrammar.BatchGrammarMatcher(), llguidance.LLExecutor()
    xg_mask = xgrammar.allocate_token_bitmask(rows, vocab)
    ll_mask = llguidance.torch.allocate_token_bitmask(rows, vocab)
    rng = random.Random(seed)
    xg_times, ll_times, disagreements = [], [], 0
    for _ in range(steps):
        start = time.perf_counter()
        batch.batch_fill_next_token_bitmask(xg_matchers, xg_mask)
        xg_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ll_matchers)], ll_mask)
        ll_times.append(time.perf_counter() - start)
        for row in range(rows):
            allowed = _allowed(xg_mask[row], vocab)
            disagreements += len(allowed) != len(_allowed(ll_mask[row], vocab))
            for token in rng.sample(allowed, min(len(allowed), 8)):  # one both accept (EOS and specials differ)
                if token != tokenizer.eos_token_id and xg_matchers[row].accept_token(token):
                    ll_matchers[row].consume_token(token)
                    break
    figures["xgrammar_fill_ms"] = statistics.median(xg_times) * 1000
    figures["llguidance_fill_ms"] = statistics.median(ll_times) * 1000
    figures["rows"], figures["steps"], figures["mask_disagreements"] = rows, steps, disagreements
    return {name: round(value, 3) if isinstance(value, float) else value for name, value in figures.items()}


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    """The token ids a bitmask row (int32 words, bit i of word w: token 32 w + i) allows."""
    bits = (bitmask_row.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


class _RawVocabulary:
    """A tokenizer whose tokens decode to their own text (the bench tokenizer's) as llguidance's TokenizerWrapper
    reads one: its tokens as bytes, special ids, an encoder. (llguidance reads Hugging Face tokenizers with byte-level
    or byte-fallback decoders only.)"""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.all_special_ids)
        by_id = {index: token for token, index in tokenizer.get_vocab().items()}
        self.tokens = [by_id[index].encode("utf-8") for index in range(len(tokenizer))]

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer(text, add_special_tokens=False)["input_ids"]
