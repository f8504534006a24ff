"""A tokenizer with a production-sized vocabulary, built in code (no hub access): what a grammar's token masks are
measured against. A grammar engine's cost per mask grows with the vocabulary and with how many tokens mix text and
syntax (`",`, ` {"`, `":`), so its tokens look like a BPE vocabulary's: every byte-level character, words and word
pieces with and without a leading space in three casings, numbers, and punctuation runs joined to letters."""

from __future__ import annotations

import itertools
import random
import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers loads when a tokenizer is built: the parser reads DEFAULT_VOCAB without it
    from transformers import PreTrainedTokenizerFast

DEFAULT_VOCAB = 128_000  # Llama 3's 128,256 and Qwen's 151,936 are this size
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PUNCTUATION_RUNS = ('",', '":', '{"', '"}', '["', '"]', "},", "],", '": "', '", "', '":"', "{\n", "\n}", '"\n', ",\n")


def bench_tokenizer(vocab_size: int = DEFAULT_VOCAB, seed: int = 0) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of `vocab_size` distinct tokens (the same for a seed), whose every token decodes to
    its own text (xgrammar reads it as a raw vocabulary).

    Args:
        vocab_size: tokens in all, the 4 special ones (<pad>, <bos>, <eos>, <unk>) included; at least 1,000.
        seed: chooses the longer word pieces.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 1000:
        raise ValueError(f"vocab_size must be at least 1000, got {vocab_size}")
    rng = random.Random(seed)
    tokens: dict[str, None] = dict.fromkeys([*SPECIAL_TOKENS, *string.printable])  # ordered, without repeats
    letters = string.ascii_lowercase
    pieces = [a + b for a in letters for b in letters] + [str(number) for number in range(1000)]
    pieces += ["".join(t) for t in itertools.product(letters, repeat=3)]
    for piece in pieces:
        for variant in (piece, " " + piece, piece.capitalize(), " " + piece.capitalize()):
            tokens.setdefault(variant)
    for run, piece in itertools.product(PUNCTUATION_RUNS, letters):
        tokens.setdefault(run + piece)
        tokens.setdefault(piece + run)
    while len(tokens) < vocab_size:  # longer pieces, as a BPE vocabulary's tail
        word = "".join(rng.choice(letters) for _ in range(rng.randint(4, 9)))
        tokens.setdefault(rng.choice(("", " ")) + (word.capitalize() if rng.random() < 0.2 else word))
    vocab = {token: index for index, token in enumerate(itertools.islice(tokens, vocab_size))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # encodes by character
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
