"""The model lent to the engines that use it: paged attention, eval mode and a sync-free experts implementation while
any engine holds it, and everything given back exactly as found when the last one lets go.

MoE models: transformers' "eager" experts loop over the experts the router picked, reading which ones back to the
host (`nonzero`, `item`), which stalls every step on a GPU and makes decode steps impossible to capture in CUDA
graphs. While lent, such a model runs transformers' own "grouped_mm" experts (one grouped matrix product, no host
read), or "batched_mm" where grouped_mm cannot dispatch.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from rollout.engine.attention.paged import register_paged_attention

logger = logging.getLogger(__name__)

# Experts implementations that read nothing back to the host, in order of preference.
SYNC_FREE_EXPERTS = ("grouped_mm", "batched_mm")


@dataclass
class _Holder:
    """What the engines sharing one model must give back when the last one closes."""

    engines: int
    attn_implementation: str
    # Every submodule's own training flag: a trainer may keep parts in eval mode (frozen embeddings, say), which
    # model.train(True) would switch on again.
    training_flags: list[tuple[torch.nn.Module, bool]]
    experts_implementation: dict | None = None  # the model's own, when the lease switched it


_HOLDERS: weakref.WeakKeyDictionary[torch.nn.Module, _Holder] = weakref.WeakKeyDictionary()


def acquire(model: torch.nn.Module) -> None:
    """Take the model for one more engine (the first one switches it, an MoE model whose experts read the host to a
    sync-free implementation included; later ones share the switch).

    Args:
        model: a transformers causal LM.
    """
    holder = _HOLDERS.get(model)
    if holder is None:
        flags = [(module, module.training) for module in model.modules()]
        holder = _HOLDERS[model] = _Holder(0, model.config._attn_implementation, flags)
        model.set_attn_implementation(register_paged_attention())
        model.eval()
        holder.experts_implementation = _switch_experts(model)
    holder.engines += 1


def release(model: torch.nn.Module) -> None:
    """Let go of the model for one engine; the last one gives everything back as it was."""
    holder = _HOLDERS[model]
    holder.engines -= 1
    if holder.engines == 0:
        del _HOLDERS[model]
        model.set_attn_implementation(holder.attn_implementation)
        if holder.experts_implementation is not None:
            model.set_experts_implementation(holder.experts_implementation)
        for module, training in holder.training_flags:
            module.training = training


def _switch_experts(model: torch.nn.Module) -> dict | None:
    """Set a sync-free experts implementation where the model's own reads the host; the model's own setting when it
    was switched, else None."""
    get = getattr(model, "get_experts_implementation", None)
    if get is None:
        return None
    own = get()
    if all(value is None or value in SYNC_FREE_EXPERTS for value in own.values()):
        return None  # no experts, or already sync-free
    for choice in SYNC_FREE_EXPERTS:
        try:
            model.set_experts_implementation({key: choice if value is not None else None for key, value in own.items()})
        except (ValueError, ImportError, RuntimeError) as error:  # transformers refuses what cannot dispatch here
            logger.debug("experts implementation %r not available: %s", choice, error)
            continue
        return own
    logger.warning("no sync-free experts implementation available (%s): MoE decode steps read the host", own)
    return None
