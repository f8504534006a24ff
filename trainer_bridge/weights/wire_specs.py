"""What a push announces: the trainer's tensors matched against the workers' own (`weights_spec_reply`), each with
the dtype it travels in. Checked here, before anything is gathered or sent."""

from __future__ import annotations

from rollout import protocol as p
from rollout.config import dtype_name
from rollout.protocol.staging import DTYPES
from trainer_bridge.client import RolloutError
from trainer_bridge.gathering import Entry


def wire_specs(
    entries: list[Entry], reference: dict[str, tuple[str, tuple[int, ...]]], adapter_names: set[str]
) -> list[p.TensorSpec]:
    """One `TensorSpec` per entry, in order: a tensor the workers hold travels in their dtype when both are floating
    point (in its own otherwise: a mismatch is for the worker to name); an adapter's tensor in its own dtype.

    Args:
        entries: the trainer's tensors to push.
        reference: the workers' tensors, name -> (wire dtype name, shape).
        adapter_names: the entries of a LoRA adapter (the workers' adapter table checks them).
    Raises:
        RolloutError: ("bad_update", naming the tensor) a name the workers' model lacks, or another shape.
    """
    specs = []
    for entry in entries:
        if entry.name in adapter_names:
            specs.append(p.TensorSpec(entry.name, dtype_name(entry.dtype), list(entry.shape)))
            continue
        target = reference.get(entry.name)
        if target is None:
            raise RolloutError("bad_update", "the workers' model has no tensor of this name", entry.name)
        dtype_wire, shape = target
        if tuple(shape) != tuple(entry.shape):
            raise RolloutError(
                "bad_update", f"shape {list(entry.shape)} does not match the workers' {list(shape)}", entry.name
            )
        if not (entry.dtype.is_floating_point and DTYPES[dtype_wire].is_floating_point):
            dtype_wire = dtype_name(entry.dtype)  # never cast integers: a mismatch is for the worker to name
        specs.append(p.TensorSpec(entry.name, dtype_wire, list(entry.shape)))
    return specs
