"""What the batch-invariant mode cannot make bit for bit, refused by name before anything runs, in the engine
(`ContinuousBatchingConfig(batch_invariant=True)`) and in the trainer (`batch_invariant(model)`) alike:

- LongRoPE (`rope_type: "longrope"`, Phi-3/3.5-128k, Phi-4-mini): transformers picks its short or long rotary factors
  per forward, from the largest position in the whole call, so a token's rotary depends on what else the call holds
  (an engine step's other sequences; the trainer's whole completion);
- transformers' `Conv1D` layers (GPT-2, its descendants): they compute with `torch.addmm`, outside the invariant
  products, whose split of the reduction depends on the number of rows;
- multi-head latent attention (`kv_lora_rank`: DeepSeek-V2/V3): keys and values of different head sizes, which the
  invariant attention does not take (the engine's paged cache refuses such models in any mode).

`rope_types` also serves the engine's warning for LongRoPE outside the mode (model_checks.py).
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.validation import FieldError


def rope_types(config: Any) -> set[str]:
    """The rotary types a text config names (`rope_parameters`, or the older `rope_scaling`; one per layer type in
    some models), "default" left out.

    Args:
        config: a transformers text config.
    """
    found: set[str] = set()
    for field in ("rope_parameters", "rope_scaling"):
        parameters = getattr(config, field, None)
        if not isinstance(parameters, dict):
            continue
        parts = [parameters] if "rope_type" in parameters or "type" in parameters else list(parameters.values())
        for part in parts:
            if isinstance(part, dict):
                kind = part.get("rope_type", part.get("type"))
                if isinstance(kind, str) and kind != "default":
                    found.add(kind)
    return found


def invariance_refusal(model: torch.nn.Module) -> str | None:
    """Why `model` cannot be computed bit for bit by the batch-invariant mode (None: it can; module docstring).

    Args:
        model: a transformers causal LM (a PeftModel of one too).
    """
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not None and "longrope" in rope_types(text):
        return (
            "LongRoPE (rope_type 'longrope') picks its rotary factors from the longest position of each forward, so "
            "a token's logits depend on the rest of the batch: not batch-invariant"
        )
    if text is not None and getattr(text, "kv_lora_rank", None):
        return "multi-head latent attention (kv_lora_rank: DeepSeek-V2/V3's MLA) is not served by the invariant mode"
    from transformers.pytorch_utils import Conv1D

    for name, module in model.named_modules():
        if isinstance(module, Conv1D):
            return (
                f"transformers' Conv1D layers (GPT-2's; first: {name}) compute with torch.addmm, outside the "
                "invariant products: not batch-invariant"
            )
    return None


def refuse_variant_model(model: torch.nn.Module) -> None:
    """Refuse a model the batch-invariant mode cannot make bit for bit.

    Raises:
        FieldError: ("batch_invariant") naming what stands in the way (`invariance_refusal`).
    """
    reason = invariance_refusal(model)
    if reason is not None:
        raise FieldError("batch_invariant", reason)
