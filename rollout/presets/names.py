"""The built-in models by the names `rollout-worker --model` takes: each preset's model and tokenizer."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from rollout.presets.agent import agent_tokenizer, scripted_agent
from rollout.presets.catalog import PRESETS, is_preset
from rollout.presets.models import sized_model, tiny_model, tiny_moe_model, tiny_tokenizer

__all__ = ["PRESETS", "is_preset", "model_from_preset", "tokenizer_for"]  # the first two from preset_catalog


def model_from_preset(
    name: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel | None:
    """The preset model `name` (one of `PRESETS`), or None when `name` is not a preset.

    Args:
        name: "tiny", "tiny-moe", "tiny-agent" (the scripted tool caller; its weights do not depend on `seed`) or
            `"sized:<MB>"`.
        seed: weight initialisation seed of the random presets.
        dtype: parameter dtype.
        device: where `"sized:<MB>"` is built (a large random model: on a GPU in well under a second); the small
            presets are built on the CPU, so that they are the same weights in every process, and moved.
    Raises:
        ValueError: a malformed "sized:" size.
    """
    if name == "tiny":
        return tiny_model(seed, dtype)
    if name == "tiny-moe":
        return tiny_moe_model(seed, dtype)
    if name == "tiny-agent":
        return scripted_agent()[0].to(dtype)
    if name.startswith("sized:"):
        try:
            megabytes = float(name.removeprefix("sized:"))
        except ValueError:
            raise ValueError("expected sized:<megabytes>, e.g. sized:512") from None
        return sized_model(megabytes, seed, dtype, device)
    return None


def tokenizer_for(name: str) -> PreTrainedTokenizerFast | None:
    """The tokenizer of a preset: `tiny_tokenizer()` for "tiny", "tiny-moe" and `"sized:<MB>"` (which share its
    vocabulary), `agent_tokenizer()` for "tiny-agent".

    Args:
        name: a preset name (`PRESETS`), or anything else (then None).
    """
    if name == "tiny-agent":
        return agent_tokenizer()
    return tiny_tokenizer() if name in ("tiny", "tiny-moe") or name.startswith("sized:") else None
