"""What a push announces: the trainer's tensors matched against the workers' own (`weights_spec_reply`), each with
the dtype it travels in. Checked here, before anything is gathered or sent."""

from __future__ import annotations

import difflib
import math

import torch

from rollout import protocol as p
from rollout.config import FieldError, dtype_name
from rollout.protocol.staging import DTYPES
from trainer_bridge.client import RolloutError
from trainer_bridge.gathering import Entry


def check_sendable(entries: list[Entry], own_dtype: bool = False) -> None:
    """Refuse, naming the tensor, one whose dtype no transport carries, before anything is gathered or sent.

    Args:
        entries: the trainer's tensors to push.
        own_dtype: they travel in their own dtype (an adapter's); else a floating-point one travels in the workers'
            floating dtype (cast), so only a dtype that is neither carried nor floating can never travel.
    Raises:
        FieldError: naming the tensor, its dtype and the dtypes carried.
    """
    for entry in entries:
        name = dtype_name(entry.dtype)
        if name not in DTYPES and (own_dtype or not entry.dtype.is_floating_point):
            raise FieldError(entry.name, _unsendable(name))


def _unsendable(dtype: str) -> str:
    return f"dtype {dtype} cannot be pushed: tensors travel as one of {', '.join(DTYPES)}"


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
        RolloutError: ("bad_update", naming the tensor) a name the workers' model lacks, another shape, or a dtype
            no transport carries.
    """
    specs = []
    for entry in entries:
        spec = _wire_spec(entry, reference, entry.name in adapter_names)
        if spec.dtype not in DTYPES:  # one check_sendable let through: a floating dtype the workers hold as no float
            raise RolloutError("bad_update", _unsendable(spec.dtype), entry.name)
        specs.append(spec)
    return specs


def _wire_spec(entry: Entry, reference: dict[str, tuple[str, tuple[int, ...]]], adapter: bool) -> p.TensorSpec:
    """`entry`'s spec: an adapter's tensor in its own dtype; another checked against the workers' `reference`."""
    if adapter:
        return p.TensorSpec(entry.name, dtype_name(entry.dtype), list(entry.shape))
    target = reference.get(entry.name)
    if target is None:
        close = difflib.get_close_matches(entry.name, list(reference), n=1, cutoff=0.8)
        reason = (
            "the workers' model has no tensor of this name"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + ": the workers serve a model of another architecture than this one (rollout-worker --model), or name "
            "its tensors otherwise"
        )
        raise RolloutError("bad_update", reason, entry.name)
    dtype_wire, shape = target
    if tuple(shape) != tuple(entry.shape):
        reason = (
            f"shape {list(entry.shape)} does not match the workers' {list(shape)}: the workers serve a model of "
            "another size or architecture than this one (for an adapter, than the base it was trained over)"
        )
        raise RolloutError("bad_update", reason, entry.name)
    if not (entry.dtype.is_floating_point and DTYPES[dtype_wire].is_floating_point):
        dtype_wire = dtype_name(entry.dtype)  # never cast integers: a mismatch is for the worker to name
    return p.TensorSpec(entry.name, dtype_wire, list(entry.shape))


# Float dtypes whose casts saturate at their largest finite value instead of overflowing (nothing to refuse).
SATURATING = frozenset(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, name))


def cast_for_wire(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in its wire dtype, refused when the cast turns finite values into Inf or NaN (e.g. 1e6 in float16):
    the worker would serve them silently and its samples would end in errors. Only a cast to a float dtype of a
    smaller range that overflows is checked (fp8 e4m3fn saturates instead), from the source's largest magnitude: one
    reduction, not a pass over the cast tensor.

    Args:
        name: the tensor's name (what a refusal names).
        tensor: the trainer's tensor, whole.
        dtype: its wire dtype (`wire_specs`).
    Raises:
        RolloutError: ("bad_update", field: the tensor) finite values beyond the wire dtype's range.
    """
    tensor = tensor.detach()
    if tensor.dtype == dtype or not (tensor.dtype.is_floating_point and dtype.is_floating_point):
        return tensor
    cast = tensor.to(dtype)
    if dtype in SATURATING or torch.finfo(dtype).max >= torch.finfo(tensor.dtype).max or not tensor.numel():
        return cast
    largest = float(tensor.abs().amax())
    if not math.isfinite(largest):  # NaN or Inf in the source: --check-finite's to refuse; its finite values here
        finite = tensor[torch.isfinite(tensor)]
        largest = float(finite.abs().amax()) if finite.numel() else 0.0
    if largest <= torch.finfo(dtype).max:
        return cast
    lost = int((tensor.abs() > torch.finfo(dtype).max).sum()) - int(torch.isinf(tensor).sum())
    raise RolloutError(
        "bad_update",
        f"{lost} finite value(s) (largest magnitude {largest:.4g}) exceed the workers' dtype {dtype_name(dtype)} "
        f"(largest finite {torch.finfo(dtype).max:.4g}) and would be served as Inf or NaN",
        name,
    )
    finite = torch.isfinite(tensor)
    lost = int(finite.sum()) - int(torch.isfinite(cast).sum())  # values non-finite already are --check-finite's
    if lost > 0:
        largest = float(tensor[finite].abs().max())
        raise RolloutError(
            "bad_update",
            f"{lost} finite value(s) (largest magnitude {largest:.4g}) exceed the workers' dtype "
            f"{dtype_name(dtype)} (largest finite {torch.finfo(dtype).max:.4g}) and would be served as Inf",
            name,
        )
    return cast
