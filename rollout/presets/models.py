"""Built-in model and tokenizer that need no download: what `rollout-worker --model tiny` serves."""

from __future__ import annotations

import itertools
import math
import string
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config, Qwen3MoeConfig

from rollout.config import MODEL_DTYPE_NAMES
from rollout.engine.kv.kv_cache import free_memory_bytes
from rollout.presets.catalog import TINY_MODEL_CONFIG  # re-exported: its callers import it from here

# Parameter dtypes by the names `rollout-worker --dtype` and `rollout-bench weights --dtype` take ("auto": the
# checkpoint's own, fp32 for presets).
MODEL_DTYPES = {name: None if name == "auto" else getattr(torch, name) for name in MODEL_DTYPE_NAMES}
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


# ChatML turns, as many chat models render them; `tools` (if given) are listed in a system turn first.
TINY_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer built in code that covers the tiny model's whole vocabulary of 1024: `<pad>`, `<bos>`, `<eos>`, `<unk>`
    (ids 0-3), printable ASCII and newline, one character each (4-99: what encoding text produces), the chat turn
    markers <|im_start|> and <|im_end|> (100-101, special), then lowercase letter pairs and triples (102-1023), so
    every id a model samples decodes to text. Its chat template renders ChatML turns (`TINY_CHAT_TEMPLATE`)."""
    chars = [*string.printable[:95], "\n"]
    pairs = [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    triples = (
        a + b + c for a in string.ascii_lowercase for b in string.ascii_lowercase for c in string.ascii_lowercase
    )
    tokens = [*SPECIAL_TOKENS, *chars, *CHAT_TOKENS, *pairs]
    tokens += list(itertools.islice(triples, TINY_MODEL_CONFIG["vocab_size"] - len(tokens)))
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=list(CHAT_TOKENS),
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


# The "sized" preset: layers of this shape (about 12.6M parameters each) on the tiny vocabulary.
SIZED_LAYER_CONFIG = dict(
    hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=64
)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A tiny random Qwen3-style model (the cpu-small benchmark shape), the same for the same seed.

    Args:
        seed: weight initialisation seed.
        dtype: parameter dtype.
    """
    return random_model(Qwen3Config(**TINY_MODEL_CONFIG), seed, dtype)


def tiny_moe_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A tiny random Qwen3-MoE (the tiny shape, every MLP 8 experts of which 2 per token), the same for the same
    seed: what `rollout-worker --model tiny-moe` serves (MoE routes, routing replay).

    Args:
        seed: weight initialisation seed.
        dtype: parameter dtype.
    """
    config = Qwen3MoeConfig(
        **TINY_MODEL_CONFIG, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1
    )
    return random_model(config, seed, dtype)


def sized_model(
    megabytes: float, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """A random Qwen3-style model with about `megabytes` MB (1e6 bytes) of weights: as many 1024-wide layers as it
    takes (at least one), on the tiny vocabulary. For weight-transfer benchmarks (`rollout-worker --model sized:512`).

    Args:
        megabytes: target size of the weights in `dtype`.
        seed: weight initialisation seed.
        dtype: parameter dtype.
        device: where the weights are built and live (a GPU fills a gigabyte in well under a second, a CPU takes
            tens of seconds); the same seed gives the same weights on the same kind of device only.
    Raises:
        ValueError: a size that is not a finite positive number, or more than `device` has available.
    """
    if not (math.isfinite(megabytes) and megabytes > 0):
        raise ValueError(f"megabytes must be a finite number > 0, got {megabytes!r}")
    available = free_memory_bytes(torch.device(device))
    if megabytes * 1e6 > available:  # it would be built until the out-of-memory killer ends the process, unsaid
        raise ValueError(
            f"{megabytes:g} MB of weights is more than the {available / 1e6:,.0f} MB available on {device}"
        )
    h, f = SIZED_LAYER_CONFIG["hidden_size"], SIZED_LAYER_CONFIG["intermediate_size"]
    heads, kv_heads, head_dim = (
        SIZED_LAYER_CONFIG[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")
    )
    per_layer = h * head_dim * (2 * heads + 2 * kv_heads) + 3 * h * f + 2 * h + 2 * head_dim
    fixed = 2 * TINY_MODEL_CONFIG["vocab_size"] * h + h
    itemsize = torch.empty(0, dtype=dtype).element_size()
    layers = max(1, round((megabytes * 1e6 / itemsize - fixed) / per_layer))
    config = Qwen3Config(
        **{**TINY_MODEL_CONFIG, **SIZED_LAYER_CONFIG, "num_hidden_layers": layers, "tie_word_embeddings": False}
    )
    return random_model(config, seed, dtype, device)


def random_model(config: Any, seed: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> PreTrainedModel:
    """A random causal LM of a transformers `config` on the tiny tokenizer's special tokens, the same for the same
    seed (the caller's RNG left as it was), in eval mode.

    Args:
        config: the model's transformers config (its vocabulary within the tiny tokenizer's).
        seed: weight initialisation seed.
        dtype: parameter dtype.
        device: where the weights are built (and stay).
    """
    device = torch.device(device)
    # Building a preset leaves the caller's RNG alone: the CPU's, and the GPU's it draws from.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tokenizer = tiny_tokenizer()
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(model.config, name, getattr(tokenizer, name))
        setattr(model.generation_config, name, getattr(tokenizer, name))
    return model.eval()
