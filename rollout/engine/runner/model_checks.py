"""What a model runner accepts and how it runs attention: the text config of a servable model (refusing models the
paged cache cannot serve) and the attention backend for a cache ("torch" or the Triton kernels)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from rollout.config import FieldError
from rollout.engine.kv.kv_cache import KVCacheShape, PagedKVCache
from rollout.engine.runner.attention_call_checks import check_attention_calls, sliding_windows
from rollout.engine.runner.attention_probe import record_attention_calls
from rollout.engine.runner.model_lease import LEASE_LOCK, is_leased
from rollout.invariant.model_support import rope_types
from rollout.presets.catalog import is_preset
from rollout.sharded_params import is_sharded

logger = logging.getLogger(__name__)


def text_config(model: torch.nn.Module) -> Any:
    """The model's text config (its own config for a text-only model)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


# Layer types (config.layer_types) whose attention the paged cache serves; recurrent or chunked layers would need
# state the engine does not keep, so such models are refused instead of generating wrong tokens.
SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}


def refuse_model_name(model: Any) -> None:
    """Refuse a model given by name (a hub id or a directory, as `from_pretrained` takes it) where a loaded model is
    needed: the message says how to load it.

    Raises:
        FieldError: ("model") `model` is a str or path.
    """
    if isinstance(model, (str, os.PathLike)):
        name = os.fspath(model)
        if is_preset(name):  # rollout-worker's built-in models: from_pretrained would look for them on the hub
            raise FieldError(
                "model",
                f"{name!r} names a built-in model, not a model: build it first, e.g. model = "
                f"rollout.presets.model_from_preset({name!r}), and pass the model",
            )
        raise FieldError(
            "model",
            f"{name!r} is a model name, not a model: load it first, e.g. model = "
            f"AutoModelForCausalLM.from_pretrained({name!r}) (from transformers), and pass the model",
        )


def servable_text_config(model: torch.nn.Module) -> Any:
    """The text config of a model the engine can serve: a transformers causal LM (a module with a `config`,
    parameters and a language-model head; not an encoder-decoder) whose layers are all attention layers the paged
    cache serves.

    Raises:
        FieldError: ("model") anything else, saying what.
    """
    refuse_model_name(model)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config") or next(model.parameters(), None) is None:
        kind = type(model).__name__
        raise FieldError(
            "model", f"expected a transformers causal LM (a module with a config and parameters), got {kind}"
        )
    kind = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise FieldError("model", f"{kind} is an encoder-decoder model (T5, BART ...): rollout serves decoder-only LMs")
    heads = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
    if hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is None and not kind.endswith(heads):
        raise FieldError(
            "model",
            f"{kind} has no language-model head (its forward gives hidden states, not logits): load the model with "
            "AutoModelForCausalLM, not AutoModel",
        )
    config = text_config(model)
    unsupported = sorted(set(getattr(config, "layer_types", None) or ()) - SUPPORTED_LAYER_TYPES)
    if unsupported:
        raise FieldError("model", f"layer types {unsupported} are not supported (only {sorted(SUPPORTED_LAYER_TYPES)})")
    if getattr(config, "kv_lora_rank", None):  # its K and V are not heads of head_dim: the cache would not fit them
        raise FieldError(
            "model", "multi-head latent attention (kv_lora_rank: DeepSeek-V2/V3's MLA) is not served by the paged cache"
        )
    if any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters()):
        raise FieldError("model", "attention sinks (GPT-OSS's sinks) are not served by rollout's paged attention")
    _refuse_own_positions(model)
    _refuse_own_attention(model)
    if "longrope" in rope_types(config):
        logger.warning(
            "%s uses LongRoPE: transformers picks its rotary factors from the longest position of each forward, so "
            "once a step holds a sequence past original_max_position_embeddings every sequence of that step gets the "
            "long factors (tokens then depend on their batch; batch_invariant refuses such a model)",
            type(model).__name__,
        )
    if "dynamic" in rope_types(config):
        logger.warning(
            "%s uses dynamic NTK RoPE: transformers recomputes its rotary frequencies from the longest position of "
            "each forward once it passes max_position_embeddings, so past that length tokens depend on their batch "
            "(batch_invariant refuses a max_model_len beyond it)",
            type(model).__name__,
        )
    return config


def _refuse_own_positions(model: torch.nn.Module) -> None:
    """Refuse a model whose learned positions start past 0 (RoBERTa's: padding_idx + 1, when it numbers them itself,
    as under `generate`): the engine's `position_ids` count from 0, so every position would be off."""
    for name, module in model.named_modules():
        if hasattr(module, "create_position_ids_from_input_ids"):
            raise FieldError(
                "model",
                f"{type(model).__name__} numbers its positions from padding_idx + 1 (RoBERTa's convention, in "
                f"{name or 'the model'}): rollout's position_ids count from 0, so every position would be off",
            )


def _refuse_own_attention(model: torch.nn.Module) -> None:
    """Refuse a model whose attention the paged cache cannot serve, from one probe forward (attention_probe.py): one
    whose implementation transformers will not switch (GPT-Neo, Bloom: their attention does not go through
    AttentionInterface; a class whose source transformers cannot read), one whose layers drop the keyword arguments,
    or whose calls show what the paged cache cannot serve (attention_call_checks.py); before anything is built. A model another engine holds passed
    this when that engine was built, and is not probed again: the probe switches its attention, which would pull it
    from under that engine's running steps."""
    shape = cache_shape(model)
    with LEASE_LOCK:  # no engine takes the model between the check and the probe (several built at once)
        _probe_attention(model, shape)


def _probe_attention(model: torch.nn.Module, shape: KVCacheShape) -> None:
    if is_leased(model):
        return
    # ZeRO-3 or FSDP2 shards (a colocated trainer's model) are whole only within a round: no forward before then,
    # so only the switch is tried, and a layer the probe would refuse fails its requests with an error naming it.
    sharded = is_sharded(model)
    calls = record_attention_calls(model, forward=not sharded)
    if calls is None:
        raise FieldError(
            "model",
            f"transformers would not switch {type(model).__name__}'s attention (it kept "
            f"{model.config._attn_implementation!r}), so rollout's paged attention cannot serve it: its attention does "
            "not go through transformers' AttentionInterface, or its class was defined where transformers cannot "
            "read its source (a notebook cell, stdin; define it in a module file)",
        )
    if sharded:
        return
    windows = sliding_windows(text_config(model))
    check_attention_calls(calls, model, shape.num_kv_heads, shape.head_dim, windows, shape.num_layers)


def cache_shape(model: torch.nn.Module) -> KVCacheShape:
    """The paged cache's shape read from the model's config.

    Raises:
        FieldError: ("model") the config gives no attention heads or head size to size it from (a recurrent model
            such as xLSTM; Gemma 4's per-layer head sizes).
    """
    try:
        return KVCacheShape.from_model_config(model.config)
    except Exception as error:  # noqa: BLE001 - a config without the fields, or one that holds them per layer
        raise FieldError(
            "model",
            f"{type(model).__name__}'s config gives no attention shape the paged cache can be sized from "
            f"(num_attention_heads, num_key_value_heads, head_dim: {type(error).__name__}: {str(error)[:200]})",
        ) from None


# Config fields naming a multimodal model's placeholder tokens (where its images, video or audio would go).
MEDIA_TOKEN_FIELDS = (
    "image_token_id",
    "image_token_index",
    "video_token_id",
    "video_token_index",
    "audio_token_id",
    "audio_token_index",
)


# The sub-configs that make a model multimodal (and may hold its placeholder ids), and Omni models' part that holds them.
MEDIA_CONFIGS = ("vision_config", "audio_config")


def media_placeholder_tokens(model: torch.nn.Module) -> dict[int, str]:
    """A multimodal model's placeholder token ids, each with the config field that names it (empty for a text-only
    model, even one whose config kept such a field from a conversion): the engine serves text only, so a prompt
    holding one would be read as a plain token, not as media."""
    config = getattr(model, "config", None)
    configs = [c for c in (config, getattr(config, "thinker_config", None)) if c is not None]
    parts = [getattr(c, name) for c in configs for name in MEDIA_CONFIGS if getattr(c, name, None) is not None]
    if not parts:
        return {}
    found = {}
    for part in configs + parts:
        for name in MEDIA_TOKEN_FIELDS:
            token = getattr(part, name, None)
            if isinstance(token, int) and not isinstance(token, bool) and token >= 0:
                found.setdefault(token, name)
    return found


def resolve_attention_backend(model: torch.nn.Module, kv_cache: PagedKVCache, backend: str) -> int | None:
    """Query heads per KV head when the Triton kernel serves attention, None for the PyTorch path.

    "auto" picks Triton on CUDA when it is installed and the block size is a power of two >= 16.
    """
    heads_per_kv = text_config(model).num_attention_heads // kv_cache.shape.num_kv_heads
    block_size = kv_cache.block_size
    block_ok = block_size >= 16 and block_size & (block_size - 1) == 0
    if backend == "torch":
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        triton_available = False
    else:
        triton_available = True
    if backend == "auto":
        on_cuda = kv_cache.kv.device.type == "cuda"
        return heads_per_kv if on_cuda and triton_available and block_ok else None
    if not triton_available:
        raise FieldError("attention_backend", "'triton' needs the triton package")
    if not block_ok:
        raise FieldError("attention_backend", f"'triton' needs a power-of-two block_size >= 16, got {block_size}")
    if kv_cache.kv.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise FieldError("attention_backend", "'triton' runs on CUDA (on CPU only inside TRITON_INTERPRET=1)")
    return heads_per_kv
