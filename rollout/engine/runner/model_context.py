"""A model's context: the longest sequence its positions were trained for (max_position_embeddings), and how far
its RoPE scaling extends it, as vLLM derives `max_model_len`. Free of torch: `rollout-worker` reads it from a
config file before torch loads.
"""

from __future__ import annotations

from typing import Any

from rollout.config import FieldError


def model_context_of(model: Any, rope_scaled: bool = False) -> int | None:
    """The context of a loaded model (its text config's max_position_embeddings); None where it gives none.

    Args:
        model: a transformers model.
        rope_scaled: as `config_context`.
    """
    return config_context(getattr(model, "config", None), rope_scaled)


def config_context(model_config: Any, rope_scaled: bool = False) -> int | None:
    """A model config's max_position_embeddings (its text config's), None where it gives none.

    Args:
        model_config: a transformers config (None: none).
        rope_scaled: the context its RoPE scaling extends it to, as vLLM derives its max_model_len (YaRN's
            original_max_position_embeddings times its factor; other types but su, longrope and llama3: the
            context times the factor), a Qwen model's --max-model-len 131072 with YaRN factor 4.
    """
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    context = getattr(text, "max_position_embeddings", None)
    if not (isinstance(context, int) and not isinstance(context, bool) and context > 0):
        return None
    scaling = (getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)) if rope_scaled else None
    if not isinstance(scaling, dict):
        return context
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling.get("factor")
    if kind in (None, "default", "su", "longrope", "llama3") or not isinstance(factor, (int, float)) or factor <= 1:
        return context
    original = scaling.get("original_max_position_embeddings") if kind == "yarn" else None
    return int((original if isinstance(original, int) and original > 0 else context) * factor)


def served_model_len(model: Any, asked: int | None) -> int:
    """The longest sequence an engine over `model` serves: `asked` (`max_model_len`), else the model's context.

    Args:
        model: a transformers model.
        asked: the engine's `max_model_len` (None: the model's context, else 2**20 for a model that gives none).
    Raises:
        FieldError: ("max_model_len") above the model's context, RoPE scaling included, as vLLM and `rollout-worker
            --max-model-len` refuse it: completions would run past the positions the model was trained for (a
            learned-position model fails them there).
    """
    ceiling = model_context_of(model, rope_scaled=True)
    if asked is None:
        context = model_context_of(model)
        return context if context is not None else 1 << 20
    if ceiling is not None and asked > ceiling:
        raise FieldError(
            "max_model_len",
            f"{asked} is above the model's context of {ceiling} tokens (its max_position_embeddings, RoPE scaling "
            "included): completions would run past the positions it was trained for",
        )
    return asked
