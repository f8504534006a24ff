"""The worker's start-up sentence on what its KV cache holds, against counts made by hand."""

from __future__ import annotations

from rollout.service.launch.cache_capacity import cache_capacity


def test_the_sentence_counts_whole_sequences_in_whole_blocks():
    # 256 blocks of 16 tokens: a 1024-token sequence takes 64 blocks (4 fit), the 2048-token context 128 (2 fit).
    assert cache_capacity(256, 16, 2048) == (
        "the KV cache holds 4096 tokens: at once 4 sequences of 1024 tokens, 2 of 2048 (the context)"
    )
    # A length that is not a multiple of the block size takes its last block whole: 1000 tokens -> 63 blocks.
    text = cache_capacity(63 * 5 + 62, 16, 1000)
    assert text == "the KV cache holds 6032 tokens: at once 5 sequences of 1000 tokens (the context)"


def test_every_planning_length_below_the_context_is_spelled_out():
    text = cache_capacity(100_000, 16, 40_960)
    assert "1562 sequences of 1024 tokens, 390 of 4096, 97 of 16384, 39 of 40960 (the context)" in text


def test_one_sequence_is_said_in_the_singular_and_a_cache_shorter_than_the_context_is_said():
    assert cache_capacity(96, 16, 2048) == (
        "the KV cache holds 1536 tokens: at once 1 sequence of 1024 tokens, 0 of 2048 (the context); not one "
        "sequence of the whole context fits: a request that needs one ends with an error"
    )
