"""Whether a model's parameters are shards (DeepSpeed ZeRO-3's partitioned parameters, FSDP2's DTensors) rather than
whole tensors: the trainer's side gathers them for a push or a colocated round, and the engine runs no forward of
its own on them before a round has gathered them (its build-time attention probe, `attention_probe.py`)."""

from __future__ import annotations

import torch


def is_zero3(param: torch.Tensor) -> bool:
    """Whether `param` is a DeepSpeed ZeRO-3 partitioned parameter (its whole shape is `ds_shape`).

    Args:
        param: a parameter.
    """
    return hasattr(param, "ds_id")


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (or the data it wraps) is a DTensor (FSDP2's shards; `full_tensor()` gathers it).

    Args:
        tensor: a parameter or tensor.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(tensor, DTensor) or isinstance(getattr(tensor, "data", None), DTensor)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether some parameter of `model` is a shard (DeepSpeed ZeRO-3, FSDP2): using it whole needs every rank.

    Args:
        model: the trainer's model, as prepared.
    """
    return any(is_zero3(param) or is_dtensor(param) for param in model.parameters())
