"""How `push_weights` sends a PEFT LoRA model (`adapters=`): "adapter" (adapter-only: the workers serve the active
adapter unmerged, `lora_push.py`), "merged" (base + LoRA delta under the base names, as a plain model), or "auto"
(the default: adapter-only when the workers can serve the adapter unmerged, else merged, with one warning per model
naming why). Merged pushes merge every LoRA the model has, LoRA on bare parameters (peft's `target_parameters`, e.g.
MoE experts, which `target_modules="all-linear"` adds on an MoE model) included (`gathering.peft_entries`).

What workers serve unmerged: LoRA on `torch.nn.Linear` layers other than the output head (no DoRA, no LoRA bias, no
fan_in_fan_out), `modules_to_save` copies of Linear and Embedding modules and of norms over the hidden states (the
output head included), and none of the PEFT settings `rollout.peft_adapters.check_peft_config` refuses (trained
biases, trainable tokens, ...), while no adapter is merged into the base weights (peft's `merge_adapter`: the
base would carry the adapter, and the workers add it again). Every rank of a multi-process trainer decides alike (the decision reads only the
model's adapter configuration). A rank above the workers' `--max-lora-rank` shows only when a push asks them: "auto"
then pushes that model merged, at once and from then on (`rank_refused`)."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

from rollout.config import FieldError
from rollout.peft_adapters import (
    active_adapter_name,
    check_peft_config,
    hidden_width,
    holds_adapter,
    is_peft_model,
    module_name,
    saved_module_refusal,
    saved_modules,
)
from trainer_bridge.gathering import merge_refusal, unwrapped
from trainer_bridge.trained_base import tied_to_a_trained_module, unfrozen_base_parameters

ADAPTER_MODES = ("auto", "adapter", "merged")
# The PEFT models "auto" already warned about (once each: a trainer pushes at every step).
_WARNED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
# The PEFT models whose adapter the workers refused for its rank (above their --max-lora-rank): "auto" pushes them
# merged from then on, without asking the workers again at every push.
_RANK_REFUSED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def check_servable(model: Any, name: str) -> None:
    """Refuse, by name, an adapter of a PEFT model that workers cannot serve unmerged (nothing is gathered).

    Args:
        model: an unwrapped `peft.PeftModel`.
        name: the adapter.
    Raises:
        FieldError: an unknown adapter, a PEFT setting, LoRA layer or saved module that cannot be served unmerged
            (named), a layer with an adapter merged into its base weights, or an adapter without any LoRA layer.
    """
    from peft.tuners.lora import LoraLayer

    if name not in model.peft_config:
        raise FieldError("adapter_name", f"the model has no adapter {name!r} (it has {sorted(model.peft_config)})")
    check_peft_config(model.peft_config[name])
    head = model.get_output_embeddings()
    heads = tuple(key for key, module in model.named_modules() if module is head and head is not None)
    layers = 0
    for key, layer in model.named_modules():
        # A merged adapter (peft's merge_adapter) lives in the base weights: an adapter-only push would send that
        # base and the workers would add the adapter to it a second time. Merged pushes merge only the rest.
        if isinstance(layer, LoraLayer) and layer.merged:
            raise FieldError(
                module_name(key),
                f"adapter {layer.merged_adapters} is merged into the base weights (merge_adapter()): an adapter-only "
                "push would serve it twice; unmerge_adapter() first",
            )
        if not isinstance(layer, LoraLayer) or not holds_adapter(layer, name):
            continue
        target, base = module_name(key), layer.get_base_layer()
        if any(key == head_key or key.startswith(f"{head_key}.") for head_key in heads):  # or a wrapper's original
            raise FieldError(target, "LoRA on the output head is not served unmerged (modules_to_save is)")
        if layer.use_dora.get(name):
            raise FieldError(target, "DoRA is not served unmerged")
        if not isinstance(base, torch.nn.Linear) or getattr(layer, "fan_in_fan_out", False):
            raise FieldError(target, f"LoRA on a {type(base).__name__} is not served unmerged (only torch.nn.Linear)")
        if getattr(layer, "lora_bias", {}).get(name):
            raise FieldError(target, "a trained LoRA bias is not served unmerged")
        layers += 1
    if not layers:
        raise FieldError("adapter_name", f"adapter {name!r} has no LoRA layer")
    hidden = hidden_width(model)
    for key, copy in saved_modules(model, name):
        refusal = saved_module_refusal(copy, hidden)
        if refusal is not None:
            raise FieldError(module_name(key), refusal)


def push_mode(source: Any, adapters: str = "auto", accelerator: Any = None, warn: bool = True) -> str:
    """How `push_weights(source, adapters=...)` sends `source`: "adapter", "merged" (a PEFT model) or "whole" (any
    other model or tensors).

    Args:
        source: what push_weights was given (a module, possibly wrapped, or tensors).
        adapters: "auto", "adapter" or "merged".
        accelerator: the `accelerate.Accelerator` of a multi-process trainer (its main process warns).
        warn: warn (once per model) when "auto" falls back to merged weights.
    Raises:
        ValueError: an unknown mode; (FieldError) with "adapter", an adapter workers cannot serve unmerged (LoRA
            on bare parameters included: `target_parameters`), named; with "auto", one that can neither be served
            unmerged nor merged on the fly.
    """
    if adapters not in ADAPTER_MODES:
        raise ValueError(f"adapters must be one of {list(ADAPTER_MODES)}, got {adapters!r}")
    if not isinstance(source, torch.nn.Module):
        return "whole"
    model = unwrapped(source, accelerator)
    if not is_peft_model(model):
        return "whole"
    tied = tied_to_a_trained_module(model, saved_copies=False)  # LoRA on a tied module: never served right
    if tied is not None:
        raise FieldError("model", tied)
    # modules_to_save on a tied module: its copy is served adapter-only, never merged into the tied tensor
    tied_copy = tied_to_a_trained_module(model)
    if adapters == "merged" or (adapters == "auto" and model in _RANK_REFUSED):
        if tied_copy is not None:
            refused = " The workers refused the adapter for its rank: raise their --max-lora-rank to serve it."
            raise FieldError("model", tied_copy + (refused if adapters == "auto" else ""))
        return "merged"  # an adapter merge_refusal names is refused by peft_entries, before anything is sent
    name = active_adapter_name(model)
    unfrozen = unfrozen_base_parameters(model)
    try:
        check_servable(model, name)
        if unfrozen:  # an adapter push sends the base once: these would stay at their first values on the workers
            raise FieldError(
                unfrozen[0], "is a base parameter trained beside the adapter; only a merged push carries it"
            )
        return "adapter"
    except FieldError as refusal:
        if adapters == "adapter":
            raise
        unmergeable = merge_refusal(model) or tied_copy
        if unmergeable is not None:
            reason = refusal.reason.split("; push with")[0]  # it cannot be: what follows says why
            raise FieldError(refusal.field, f"{reason}, and {unmergeable}") from None
        if warn:
            _warn_merged(model, f"{refusal.field}: {refusal.reason}", accelerator)
        return "merged"


def rank_refused(source: Any, field: str | None, reason: str, accelerator: Any = None) -> None:
    """Remember that the workers refused `source`'s adapter for its rank (above their `max_lora_rank`): "auto"
    pushes it merged from then on (`push_mode`), with one warning per model naming why. Every rank of a
    multi-process trainer calls this alike, so that each decides the same afterwards.

    Args:
        source: what push_weights was given (a PEFT model, possibly wrapped).
        field: the tensor the workers named.
        reason: their words.
        accelerator: the `accelerate.Accelerator` of a multi-process trainer (its main process warns).
    """
    model = unwrapped(source, accelerator)
    _RANK_REFUSED.add(model)
    _warn_merged(model, f"{field}: {reason}", accelerator)


def _warn_merged(model: Any, why: str, accelerator: Any, stacklevel: int = 4) -> None:
    """Warn, once per model and on the main process only, that "auto" pushes `model` merged, and why."""
    if model in _WARNED or (accelerator is not None and not accelerator.is_main_process):
        return
    _WARNED.add(model)
    why = why.split("; push with")[0]  # what follows is what this does
    warnings.warn(
        f"push_weights: adapter {active_adapter_name(model)!r} cannot be served adapter-only ({why}); "
        "pushing merged weights (base + LoRA delta, the whole model at every push) instead. "
        "adapters='merged' says so without this warning; adapters='adapter' makes it an error.",
        stacklevel=stacklevel,
    )
