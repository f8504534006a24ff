"""Loading what `rollout-worker` serves: the model (a preset, a local directory or a hub id) and its tokenizer."""

from __future__ import annotations

import logging

import torch

from rollout.service.preset_names import model_from_preset, tokenizer_for

logger = logging.getLogger("rollout.worker")


def load_model(name: str, dtype: torch.dtype | None, device: torch.device) -> torch.nn.Module:
    """A preset, or `from_pretrained` of a local directory / hub id."""
    preset = model_from_preset(name, dtype=dtype or torch.float32)
    if preset is not None:
        return preset.to(device)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype or "auto").to(device).eval()


def load_tokenizer(model: str, tokenizer: str | None) -> tuple[object | None, str | None]:
    """(the tokenizer, where it came from) for `--model model --tokenizer tokenizer`; (None, None) without one.

    Raises:
        ValueError / OSError: an explicit --tokenizer that cannot be loaded.
    """
    if tokenizer is not None and tokenizer.lower() == "none":
        return None, None
    from transformers import AutoTokenizer

    if tokenizer is not None:
        preset = tokenizer_for(tokenizer)
        return (preset, tokenizer) if preset is not None else (AutoTokenizer.from_pretrained(tokenizer), tokenizer)
    preset = tokenizer_for(model)
    if preset is not None:
        return preset, model
    try:
        return AutoTokenizer.from_pretrained(model), model
    except (ValueError, OSError) as error:  # a model without a tokenizer still serves token ids
        logger.warning("--model %s has no tokenizer (%s): stop strings and text endpoints are off", model, error)
        return None, None
