"""What the batch-invariant mode cannot make bit for bit, refused by name before anything runs, in the engine
(`ContinuousBatchingConfig(batch_invariant=True)`) and in the trainer (`batch_invariant(model)`) alike:

- LongRoPE (`rope_type: "longrope"`, Phi-3/3.5-128k, Phi-4-mini): transformers picks its short or long rotary factors
  per forward, from the largest position in the whole call, so a token's rotary depends on what else the call holds
  (an engine step's other sequences; the trainer's whole completion);
- transformers' `Conv1D` layers (GPT-2, its descendants): they compute with `torch.addmm`, outside the invariant
  products, whose split of the reduction depends on the number of rows;
- attention sinks (GPT-OSS's `sinks` parameters), which the invariant attention does not compute (the engine's paged
  attention refuses them in any mode);
- multi-head latent attention (`kv_lora_rank`: DeepSeek-V2/V3): keys and values of different head sizes, which the
  invariant attention does not take (the engine's paged cache refuses such models in any mode);
- layers other than full or sliding attention (`config.layer_types`: Qwen3-Next's and MiniMax's linear attention,
  Llama 4's chunked attention, hybrid Mamba models): they do not go through the invariant attention, and their own
  arithmetic (a recurrence, chunks counted from a padded row's first column) depends on the layout (measured: Qwen3-Next
  0.06 nats in bf16 between a padded batch and a row alone; the engine refuses them in any mode);
- ALiBi (`config.alibi`: Falcon's), whose position biases come to the attention as a float mask of the model's own,
  which the invariant attention does not compute;
- a `torch.compile`d model (`torch.compile(model)`, `model.compile()`, a trainer's `torch_compile`): its compiled
  graph runs inductor's fused kernels in place of the invariant operations (measured: 5.7e-6 in fp32 from the
  engine);
- dynamic NTK RoPE (`rope_type: "dynamic"`) past the length it was trained for: transformers recomputes its rotary
  frequencies from the largest position of a forward once it passes the rotary's `original_max_seq_len` (the
  config's max_position_embeddings), and keeps them, so a token's logits depend on the rest of the call. Within
  that length its frequencies never change: the engine refuses it only with a `max_model_len` beyond it, the
  trainer's block only a forward that reaches past it (`dynamic_rope_length`, `refuse_long_dynamic_rope`).

`rope_types` also serves the engine's warnings for LongRoPE and dynamic NTK RoPE outside the mode (model_checks.py).
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.validation import FieldError

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}  # the layer types the invariant attention computes


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
    other_layers = sorted(set(getattr(text, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if other_layers:
        return (
            f"layer types {other_layers} (config.layer_types) do not go through the invariant attention (only "
            f"{sorted(ATTENTION_LAYER_TYPES)} do): not batch-invariant"
        )
    if text is not None and getattr(text, "alibi", False) is True:
        return (
            "ALiBi (config.alibi, Falcon's) adds its position biases to the attention as a float mask of the model's "
            "own, which the invariant attention does not compute: not batch-invariant"
        )
    compiled = _compiled(model)
    if compiled is not None:
        return (
            f"{compiled} is torch.compile'd: its compiled graph runs inductor's fused kernels, not the invariant "
            "operations; pass the model uncompiled (a trainer: leave torch_compile off)"
        )
    if text is not None and getattr(text, "kv_lora_rank", None):
        return "multi-head latent attention (kv_lora_rank: DeepSeek-V2/V3's MLA) is not served by the invariant mode"
    sinks = next((name for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1] == "sinks"), None)
    if sinks is not None:
        return f"attention sinks (GPT-OSS's; first: {sinks}) are not computed by the invariant attention"
    from transformers.pytorch_utils import Conv1D

    for name, module in model.named_modules():
        if isinstance(module, Conv1D):
            return (
                f"transformers' Conv1D layers (GPT-2's; first: {name}) compute with torch.addmm, outside the "
                "invariant products: not batch-invariant"
            )
    return None


def _compiled(model: torch.nn.Module) -> str | None:
    """Which of `model`'s modules runs compiled: "the model" for `torch.compile(model)`'s wrapper, or the first
    module compiled in place (`nn.Module.compile`); None when none is."""
    if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":  # without importing torch._dynamo
        return "the model"
    for name, module in model.named_modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            return f"module {name!r}" if name else "the model"
    return None


def refuse_variant_model(model: torch.nn.Module, max_length: int | None = None) -> None:
    """Refuse a model the batch-invariant mode cannot make bit for bit.

    Args:
        model: a transformers causal LM (a PeftModel of one too).
        max_length: the longest sequence it will run (the engine's max_model_len); None: not known (the trainer's
            block, which checks each forward's positions instead: `refuse_long_dynamic_rope`).
    Raises:
        FieldError: ("batch_invariant") naming what stands in the way (`invariance_refusal`, or a dynamic NTK RoPE
            shorter than max_length).
    """
    reason = invariance_refusal(model)
    if reason is not None:
        raise FieldError("batch_invariant", reason)
    length = dynamic_rope_length(model)
    if max_length is not None and length is not None and max_length > length:
        raise FieldError(
            "batch_invariant",
            f"dynamic NTK RoPE (rope_type 'dynamic') recomputes its rotary frequencies from the longest position of "
            f"each forward past {length} tokens, so a token's logits would depend on the rest of the batch: not "
            f"batch-invariant with max_model_len {max_length}; set max_model_len to at most {length}",
        )


def _is_dynamic_rotary(module: torch.nn.Module) -> bool:
    """Whether `module` is a transformers rotary embedding whose frequencies follow the forward (dynamic NTK)."""
    kind = getattr(module, "rope_type", None)
    kinds = kind.values() if isinstance(kind, dict) else [kind]  # one per layer type in some models
    return hasattr(module, "original_max_seq_len") and any(isinstance(k, str) and "dynamic" in k for k in kinds)


def dynamic_rope_length(model: torch.nn.Module) -> int | None:
    """The longest sequence a dynamic NTK rotary embedding of `model` keeps its frequencies for (transformers'
    `original_max_seq_len`: a forward with a position past it rescales them); None when it has none.

    Args:
        model: a transformers causal LM (a PeftModel of one too).
    """
    lengths = [int(module.original_max_seq_len) for module in model.modules() if _is_dynamic_rotary(module)]
    return min(lengths) if lengths else None


def positions_unreadable() -> bool:
    """Whether a CUDA graph is being captured on this thread's stream (reading a tensor on the host would break it)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refuse_long_dynamic_rope(model: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Forward pre-hooks on `model`'s dynamic NTK rotary embeddings that refuse a forward reaching past the length
    they keep their frequencies for (the trainer's block: it does not know its sequences' lengths beforehand).

    Returns:
        The hooks' handles (for the caller to remove).
    """

    def check(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if positions_unreadable():  # an engine's graph capture (its max_model_len was checked instead): no host read
            return
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if positions is not None and positions.numel() and int(positions.max()) + 1 > module.original_max_seq_len:
            raise FieldError(
                "batch_invariant",
                f"dynamic NTK RoPE (rope_type 'dynamic') recomputes its rotary frequencies from the longest position "
                f"of each forward past {module.original_max_seq_len} tokens, and this forward reaches position "
                f"{int(positions.max())}: a token's logits would depend on the rest of the batch",
            )

    return [
        module.register_forward_pre_hook(check, with_kwargs=True)
        for module in model.modules()
        if _is_dynamic_rotary(module)
    ]
