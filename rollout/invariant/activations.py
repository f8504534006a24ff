"""Activation functions whose value for an element does not depend on where the element sits in its tensor.

torch's CPU kernels for SiLU and tanh-GELU run a SIMD loop and send the elements left over at the end of each
thread's share through a scalar loop that rounds differently: a row's bits then depend on the tensor's size and the
thread count (measured: a width of 300 at 1-5 threads, 3072 at 5, 11008 at 3). `exp`, `tanh` and the four arithmetic
operations give every element the same bits wherever it sits, so these are written with them, in fp32, and cast back
to the input's dtype as torch's kernels do. `swaps.py` runs a model's activation modules through them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

GELU_TANH_SCALE = math.sqrt(2 / math.pi)


def invariant_silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), as x / (1 + exp(-x)) in fp32.

    Args:
        x: any floating-point tensor.
    """
    y = x.float()
    return (y / (1 + torch.exp(-y))).to(x.dtype)


def invariant_gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in fp32.

    Args:
        x: any floating-point tensor.
    """
    y = x.float()
    return (0.5 * y * (1 + torch.tanh(GELU_TANH_SCALE * (y + 0.044715 * y * y * y)))).to(x.dtype)


@functools.cache
def _by_class() -> dict[type, Callable[[torch.Tensor], torch.Tensor]]:
    from transformers import activations

    table: dict[type, Callable[[torch.Tensor], torch.Tensor]] = {torch.nn.SiLU: invariant_silu}
    for name, function in (("SiLUActivation", invariant_silu), ("GELUTanh", invariant_gelu_tanh)):
        cls = getattr(activations, name, None)
        if cls is not None:
            table[cls] = function
    return table


def invariant_activation(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The position-invariant function that computes what `module` does (None: none here; it runs as it is).

    Args:
        module: an activation module (transformers' `ACT2FN` entries: SiLU, tanh-GELU; `nn.GELU(approximate="tanh")`).
    """
    if isinstance(module, torch.nn.GELU):
        return invariant_gelu_tanh if module.approximate == "tanh" else None
    function = _by_class().get(type(module))
    return function if function is not None and "forward" not in module.__dict__ else None
