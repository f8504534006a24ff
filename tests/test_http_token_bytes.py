"""Chat log-probs' `bytes` are each token's own UTF-8 bytes (OpenAI's field, there so that a client joins the tokens
that split a character), for byte-level BPE tokenizers and SentencePiece byte fallback: never U+FFFD's bytes."""

from __future__ import annotations

import pytest
import torch
from http_helpers import openai_client, serving
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config

from rollout.detokenizer import BYTE_LEVEL_ALPHABET, TokenBytes
from rollout.presets.models import TINY_MODEL_CONFIG, random_model
from rollout.service.http.serving.settings import HttpSettings

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0-3, as the tiny model's config has them


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2's alphabet, no merges): a character outside ASCII is one token per byte."""
    vocab = {token: index for index, token in enumerate(SPECIALS)}
    for character in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[character] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return tokenizer


def test_the_byte_level_alphabet_is_the_tokenizers():
    assert set(BYTE_LEVEL_ALPHABET) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(BYTE_LEVEL_ALPHABET.values()) == list(range(256))


@pytest.fixture(scope="module")
def api():
    tokenizer = byte_level_tokenizer()
    model = random_model(Qwen3Config(**{**TINY_MODEL_CONFIG, "vocab_size": len(tokenizer)}), 0, torch.float32)
    settings = HttpSettings(max_n=4, max_prompt_len=128)
    with serving(model, tokenizer, settings) as http, openai_client(http.url) as client:
        yield client, tokenizer


def test_chat_logprob_bytes_join_into_the_text_of_characters_split_across_tokens(api):
    client, tokenizer = api
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "caf\u00e9"}],
        max_tokens=12,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True, "structured_outputs": {"choice": ["\u00e9\u20acok"]}},
    )
    choice = answer.choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.message.content == "\u00e9\u20acok" and len(ids) >= 7  # é and € are 2 and 3 one-byte tokens
    entries = choice.logprobs.content
    joined = b"".join(bytes(entry.bytes) for entry in entries)
    assert joined.decode("utf-8") == tokenizer.decode(ids, skip_special_tokens=False)
    assert entries[0].bytes == [0xC3]  # the first byte of "é", not U+FFFD's EF BF BD
    for entry in entries:  # each top alternative carries its own bytes too
        for top in entry.top_logprobs:
            assert top.bytes != list("\ufffd".encode()), top


def test_sentencepiece_byte_fallback_pieces_give_their_byte():
    vocab = {token: index for index, token in enumerate(SPECIALS)}
    vocab |= {f"<0x{byte:02X}>": len(vocab) + byte for byte in range(256)}
    vocab["\u2581a"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    token_bytes = TokenBytes(tokenizer)
    ids = [vocab["\u2581a"], vocab["<0xE2>"], vocab["<0x82>"], vocab["<0xAC>"]]
    got = [token_bytes(token, tokenizer.decode([token])) for token in ids]
    assert got == [[0x20, 0x61], [0xE2], [0x82], [0xAC]]
    assert bytes(sum(got, [])).decode("utf-8") == tokenizer.decode(ids) == " a\u20ac"
