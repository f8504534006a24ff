"""The model the host-time and long-tail benchmarks run with its forward stubbed: a tiny Qwen3 config that only gives
the KV cache its shape (64-token vocabulary, one layer, one 16-wide KV head)."""

from __future__ import annotations

import torch

VOCAB = 64


def stub_model(max_position_embeddings: int = 8192, vocab_size: int = VOCAB) -> torch.nn.Module:
    """The stub model, the same for every call (seeded), in eval mode on the CPU.

    Args:
        max_position_embeddings: the longest sequence it is configured for (the engine's max_model_len).
        vocab_size: its logits' width (a tokenizer's, when grammars mask them).
    """
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=max_position_embeddings,
    )
    return AutoModelForCausalLM.from_config(config).eval()
