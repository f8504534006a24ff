"""Built-in model and tokenizer that need no download: what `rollout-worker --model tiny` serves."""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config

PRESETS = ("tiny",)
# The "tiny" preset's shape, which is also DESIGN.md's cpu-small benchmark model.
TINY_MODEL_CONFIG = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
)
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer built in code: printable ASCII and newline, plus <pad>, <bos>, <eos>, <unk>
    (ids 0-99, inside the tiny model's vocabulary of 1024)."""
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *string.printable[:95], "\n"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A tiny random Qwen3-style model (the cpu-small benchmark shape), the same for the same seed.

    Args:
        seed: weight initialisation seed.
        dtype: parameter dtype.
    """
    config = Qwen3Config(**TINY_MODEL_CONFIG)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.random.set_rng_state(generator_state)  # building a preset leaves the caller's RNG alone
    tokenizer = tiny_tokenizer()
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(model.config, name, getattr(tokenizer, name))
        setattr(model.generation_config, name, getattr(tokenizer, name))
    return model.eval()
