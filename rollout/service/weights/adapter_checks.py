"""What a worker checks when a weight update announces a LoRA adapter (`WeightsBegin.adapter`), before any byte of it
arrives: the adapter's name and scalings, that the update is for the base weights the worker serves (or brings
the whole base along), and every tensor against the engine's adapter table (module, shape, rank, free slot) or,
for the base, the model."""

from __future__ import annotations

import math

from rollout.config import FieldError
from rollout.engine.engine import Engine
from rollout.engine.lora.adapter_weights import is_adapter_tensor
from rollout.protocol import messages as p


class BaseMismatch(FieldError):
    """An adapter update for base weights the worker does not serve (error code "base_mismatch")."""


def brings_base(begin: p.WeightsBegin) -> bool:
    """Whether an adapter update brings base weights beside its own tensors (the whole base, in its transaction)."""
    return any(not is_adapter_tensor(spec.name, begin.scalings) for spec in begin.tensors)


def check_adapter_fields(
    begin: p.WeightsBegin, engine: Engine, base_id: str | None, base_names: frozenset[str | None] = frozenset()
) -> None:
    """Check an adapter update's announcement.

    Args:
        begin: the weights_begin (its `adapter` is set).
        engine: the worker's engine (its adapter table is read, not changed).
        base_id: the base weights the worker serves (None: unnamed, e.g. as loaded at start).
        base_names: every name of the same weights (`ServedBase.names`: an adapter update naming one needs no base).
    Raises:
        BaseMismatch: ("base_id") the update is for another base, or names none while the worker's base is named.
        FieldError: a bad name, scaling, tensor (named), `partial`, `max_loras` or `max_lora_rank`.
    """
    if begin.partial:
        raise FieldError("partial", "an adapter update brings the whole adapter")
    names = {spec.name for spec in begin.tensors if is_adapter_tensor(spec.name, begin.scalings)}
    base = {spec.name: (spec.dtype, tuple(spec.shape)) for spec in begin.tensors if spec.name not in names}
    if base:  # the whole base travels with the adapter, in the same transaction
        engine.weight_table.check_specs(base, partial=False)
    elif begin.base_id != base_id and begin.base_id not in base_names:
        raise BaseMismatch(
            "base_id",
            f"the adapter is for base {begin.base_id!r} but this worker serves base {base_id!r}: send the base "
            "weights with it (push_weights does)",
        )
    for module, scaling in begin.scalings.items():
        if f"{module}.lora_A" not in names:
            raise FieldError(f"scalings.{module}", "a scaling for a module the adapter brings no tensors for")
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
            raise FieldError(f"scalings.{module}", f"must be a finite number, got {scaling!r}")
    specs = {spec.name: (spec.dtype, tuple(spec.shape)) for spec in begin.tensors if spec.name in names}
    engine.runner.adapters.check_specs(begin.adapter, specs)
