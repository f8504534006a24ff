"""The vocabulary a grammar is matched over (`grammar_tokenizer_info`): xgrammar's TokenizerInfo of the tokenizer,
with its special tokens made unmatchable. xgrammar counts as special only tokens that decode to nothing; a
tokenizer whose special tokens decode to their own text (`<|im_end|>`, `<eos>`) would otherwise let a grammar spell
that text with them: a regex `<[a-z|_]{3,9}>[0-9]` matched by the end-of-turn token, then dropped from the returned
text. Special tokens decode to nothing here: they never match text, and the stop tokens still end a sample."""

from __future__ import annotations

from typing import Any

import xgrammar


def grammar_tokenizer_info(tokenizer: Any, vocab_size: int) -> xgrammar.TokenizerInfo:
    """xgrammar's TokenizerInfo of `tokenizer` over `vocab_size` ids, its special tokens unmatchable.

    Args:
        tokenizer: a Hugging Face tokenizer.
        vocab_size: the model's vocabulary size (the logits' width).
    """
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    decoded = list(info.decoded_vocab)
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
    special |= {int(i) for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items() if added.special}
    special = {i for i in special if i < len(decoded) and decoded[i]}
    if not special:
        return info
    for token in special:
        decoded[token] = b""
    return xgrammar.TokenizerInfo(
        decoded,
        xgrammar.VocabType.RAW,
        vocab_size=info.vocab_size,
        stop_token_ids=list(info.stop_token_ids),
        add_prefix_space=False,
    )
