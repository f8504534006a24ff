"""The trainer's model as a colocated round reads it (colocated.py): FSDP2 modules unsharded once for the whole round,
a PEFT model's adapters merged into its base weights and restored bit for bit after, and where each parameter's data
lives (a round that finds them moved captures its CUDA graphs anew: the old ones read the old tensors)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from trainer_bridge.trained_base import tied_to_a_trained_module


def parameter_storage(model: torch.nn.Module) -> list[int]:
    """Where each parameter's data lives now (compared with the last round's: graphs read the tensors they captured).

    Args:
        model: the trainer's model.
    """
    return [param.data_ptr() for param in model.parameters()]


@contextlib.contextmanager
def fsdp2_unsharded(model: torch.nn.Module) -> Iterator[None]:
    """The FSDP2 (`fully_shard`) modules of `model` unsharded once for a whole round (one all-gather each, every
    rank taking part), with resharding after forward off so that the round's forwards gather nothing; afterwards
    resharded, each module's setting as it was. A model without FSDP2 modules is left alone."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        FSDPModule = ()  # noqa: N806
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    settings = [(module, _reshards_after_forward(module)) for module in modules]
    for module in modules:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module, reshard in settings:
            module.set_reshard_after_forward(reshard, recurse=False)
            module.reshard()


def _reshards_after_forward(module: Any) -> bool:
    """An FSDP2 module's reshard_after_forward (FSDP2 has a setter but no getter: read from its parameter group)."""
    group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
    return group is None or getattr(group, "post_forward_mesh_info", True) is not None


@contextlib.contextmanager
def peft_merged(model: torch.nn.Module) -> Iterator[None]:
    """A PEFT model's active adapters merged into its base weights for the duration; afterwards the adapters are
    unmerged and every adapted base weight is copied back from a copy taken first, so the model is bit-identical."""
    # (modules_to_save copies are not merged: their wrapper picks the copy, the tied tensor stays as it is)
    tied = tied_to_a_trained_module(model, saved_copies=False) if hasattr(model, "get_base_model") else None
    if tied is not None:  # merged in place, the shared tensor would change the tied head too: not the trainer's model
        raise ValueError(f"peft_merge: {tied}")
    layers = [m for m in model.modules() if hasattr(m, "merge") and hasattr(m, "get_base_layer") and not m.merged]
    saved = [(layer.get_base_layer().weight, layer.get_base_layer().weight.detach().clone()) for layer in layers]
    with torch.no_grad():
        for layer in layers:
            layer.merge()
    try:
        yield
    finally:
        with torch.no_grad():
            for layer in layers:
                layer.unmerge()
            for weight, copy in saved:
                weight.copy_(copy)
