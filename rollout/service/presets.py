"""Built-in models that need no download: what `rollout-worker --model tiny` serves."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config

PRESETS = ("tiny",)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A tiny random Qwen3-style model (the cpu-small benchmark shape), the same for the same seed.

    Args:
        seed: weight initialisation seed.
        dtype: parameter dtype.
    """
    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.random.set_rng_state(generator_state)  # building a preset leaves the caller's RNG alone
    return model.eval()
