"""How large adapters may be: the rank and memory the stacked layout may take (`check_rank_limit`, `check_room`),
and an adapter's numbers: an adapter whose delta can overflow the serving dtype is refused, by name,
before it is served (with or without check_finite), so its samples can never turn to NaN or Inf and leave them in KV
blocks.

A LoRA module's output gains s * B (A x), computed in fp32 and rounded to the model's dtype. For an input whose
entries are at most X, every entry of the delta is at most gain * X, where gain = |s| * ||B|| * ||A|| and ||M|| is
M's largest row sum of absolute values (the norm the infinity norm of vectors induces: a sound bound, and never
looser than max|s B A| times in_features). The bounds, each a square root of a largest finite value so that an
activation may be as large again:
- gain <= sqrt(finfo(serving dtype).max): 256 for float16, about 1.8e19 for bfloat16 and float32;
- |s|, ||A|| and ||B|| * ||A|| <= sqrt(finfo(float32).max): the fp32 intermediates (x A^T, then B times it) and the
  scaling itself stay finite.
Real adapters are far inside them (entries around 1e-2, rank 8-64, in_features 4096: gain around 10-100).

A module trained whole (modules_to_save) replaces the base's weights for the adapter's tokens: its entries must be at
most sqrt(finfo(serving dtype).max), as real weights are.
"""

from __future__ import annotations

import math

import torch

from rollout.config import FieldError, dtype_name
from rollout.engine.kv.kv_cache import GIB, free_memory_bytes
from rollout.engine.lora.adapter_weights import AdapterModules, LoraModule, SavedModule
from rollout.engine.lora.layers import layer_bytes

FP32_ROOT = math.sqrt(torch.finfo(torch.float32).max)


def dtype_root(dtype: torch.dtype) -> float:
    """sqrt(finfo(dtype).max): the most an adapter may amplify its input by in a model of this dtype."""
    return math.sqrt(torch.finfo(dtype).max) if dtype.is_floating_point else FP32_ROOT


def row_norm(tensor: torch.Tensor) -> float:
    """The largest row sum of absolute values (in float64; inf or NaN when the tensor holds them)."""
    return float(tensor.detach().double().abs().sum(dim=-1).max()) if tensor.numel() else 0.0


def check_magnitudes(modules: AdapterModules, dtype: torch.dtype) -> None:
    """Refuse an adapter whose delta can overflow a model of `dtype` (see the module docstring).

    Args:
        modules: the adapter's modules (`LoraModule` pairs and `SavedModule` copies).
        dtype: the served model's dtype.
    Raises:
        FieldError: the culprit, named: "scalings.<module>", "<module>.lora_A" or "<module>.lora_B" (whichever
            factor is the largest), or "<module>.modules_to_save.<p>", saying what overflows and the bound.
    """
    limit = dtype_root(dtype)
    for module, weights in modules.items():
        if isinstance(weights, SavedModule):
            for part, tensor in weights.params.items():
                _check_saved(f"{module}.modules_to_save.{part}", tensor, limit, dtype)
            continue
        _check_pair(module, weights, limit, dtype)


def _check_pair(module: str, pair: LoraModule, limit: float, dtype: torch.dtype) -> None:
    scaling, norm_a, norm_b = abs(pair.scaling), row_norm(pair.lora_A), row_norm(pair.lora_B)
    fields = {f"scalings.{module}": scaling, f"{module}.lora_A": norm_a, f"{module}.lora_B": norm_b}
    for field, value in fields.items():
        if not math.isfinite(value):
            raise FieldError(field, "holds NaN or Inf" if "lora_" in field else f"must be finite, got {value}")
    if scaling > FP32_ROOT:
        raise FieldError(
            f"scalings.{module}",
            f"scaling {pair.scaling:.3g} (lora_alpha / r) is past {FP32_ROOT:.3g} = sqrt(finfo(float32).max): "
            "its products overflow the fp32 adapter math",
        )
    gain = scaling * norm_b * norm_a
    if norm_a <= FP32_ROOT and norm_b * norm_a <= FP32_ROOT and gain <= limit:
        return
    culprit = max(fields, key=lambda field: math.log10(fields[field]) if fields[field] > 0 else -math.inf)
    raise FieldError(
        culprit,
        f"the adapter on {module} can overflow a {dtype_name(dtype)} model: scaling {pair.scaling:.3g} x "
        f"lora_B {norm_b:.3g} x lora_A {norm_a:.3g} (largest row sums of |entries|) = gain {gain:.3g}, past "
        f"{limit:.3g} = sqrt(finfo({dtype_name(dtype)}).max) (and the fp32 intermediates' {FP32_ROOT:.3g})",
    )


def _check_saved(field: str, tensor: torch.Tensor, limit: float, dtype: torch.dtype) -> None:
    largest = float(tensor.detach().double().abs().max()) if tensor.numel() else 0.0
    if not math.isfinite(largest):
        raise FieldError(field, "holds NaN or Inf")
    if largest > limit:
        raise FieldError(
            field,
            f"an entry of {largest:.3g} can overflow a {dtype_name(dtype)} model: a module trained whole keeps its "
            f"entries within {limit:.3g} = sqrt(finfo({dtype_name(dtype)}).max)",
        )


def check_rank_limit(linears: list[torch.nn.Linear], max_rank: int) -> None:
    """Refuse a max_lora_rank no adapter of this model can use (a clear error at start instead of a failed allocation
    of, say, 800 GB when the first adapter arrives; `check_room` then bounds what an adapter's layers take).

    Args:
        linears: the Linear layers adapters may target.
        max_rank: the highest rank accepted.
    Raises:
        FieldError: ("max_lora_rank") above the largest min(in_features, out_features) of `linears`.
    """
    highest = max((min(linear.in_features, linear.out_features) for linear in linears), default=max_rank)
    if max_rank > highest:
        raise FieldError(
            "max_lora_rank",
            f"{max_rank} is above {highest}, the largest min(in_features, out_features) of the model's Linear layers: "
            "B @ A never has a higher rank, so a higher max_lora_rank only costs memory",
        )


def check_room(
    linears: list[torch.nn.Linear],
    max_loras: int,
    max_rank: int,
    device: torch.device,
    what: str,
    saved_bytes: int = 0,
) -> None:
    """Refuse stacked weights for `linears`, and copies of modules trained whole, that the device's free memory
    cannot hold (checked before an adapter adds them: an allocation that fails halfway would fail the update late).

    Args:
        linears: the Linear layers to be given stacked weights.
        max_loras: adapters served at once.
        max_rank: the highest rank accepted.
        device: where they go.
        what: the adapter, as the error names it.
        saved_bytes: the bytes of the adapter's new modules_to_save copies.
    Raises:
        FieldError: ("max_lora_rank") the stacked weights, or ("modules_to_save") the copies with them, naming the
            bytes needed and free.
    """
    needed = sum(layer_bytes(linear, max_loras, max_rank) for linear in linears)
    free = free_memory_bytes(device)
    if needed > free:
        raise FieldError(
            "max_lora_rank",
            f"{max_rank} (with max_loras {max_loras}): the stacked LoRA weights of the {len(linears)} Linear layers "
            f"{what} adds need {needed / GIB:.3g} GiB "
            f"(max_loras x max_lora_rank x (in + out) fp32 per Linear) but {device} has {free / GIB:.3g} GiB free; "
            "lower max_lora_rank or max_loras",
        )
    if needed + saved_bytes > free:
        raise FieldError(
            "modules_to_save",
            f"the copies of the modules {what} trains whole need {saved_bytes / GIB:.3g} GiB (one whole copy per "
            f"adapter), with {needed / GIB:.3g} GiB of new stacked LoRA weights, but {device} has {free / GIB:.3g} "
            "GiB free; serve fewer adapters that save whole modules",
        )
