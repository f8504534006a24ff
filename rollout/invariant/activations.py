"""Activation functions whose value for an element does not depend on where the element sits in its tensor.

torch's CPU kernels for SiLU and tanh-GELU run a SIMD loop and send the elements left over at the end of each
thread's share through a scalar loop that rounds differently: a row's bits then depend on the tensor's size and the
thread count (measured: a width of 300 at 1-5 threads, 3072 at 5, 11008 at 3). `exp`, `tanh` and the four arithmetic
operations give every element the same bits wherever it sits, so these are written with them, in fp32, and cast back
to the input's dtype as torch's kernels do. `swaps.py` runs a model's activation modules through them, and
`InvariantLinearMode` (mode.py) the functional calls of sigmoid and SiLU a module swap cannot see (Qwen2-MoE's
shared-expert gate, sigmoid routers): `invariant_function`.

Their backward is torch's own (`silu_backward`, `sigmoid_backward`): the formulas' own autograd gives NaN where
`exp(-x)` overflows (x below about -88: inf / inf), where torch's gives 0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

GELU_TANH_SCALE = math.sqrt(2 / math.pi)


def _silu(x: torch.Tensor) -> torch.Tensor:
    y = x.float()
    return (y / (1 + torch.exp(-y))).to(x.dtype)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return (1 / (1 + torch.exp(-x.float()))).to(x.dtype)


def _silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.silu_backward(grad, x)


def _sigmoid_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.sigmoid_backward(grad, torch.sigmoid(x))


class _TorchBackward(torch.autograd.Function):
    """An invariant forward, the backward of torch's own function (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward: Callable, backward: Callable) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.backward = backward
        return forward(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (x,) = ctx.saved_tensors
        return ctx.backward(grad, x), None, None


def invariant_silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), as x / (1 + exp(-x)) in fp32 (the backward torch's).

    Args:
        x: any floating-point tensor.
    """
    if torch.is_grad_enabled() and x.requires_grad:
        return _TorchBackward.apply(x, _silu, _silu_backward)
    return _silu(x)


def invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x), as 1 / (1 + exp(-x)) in fp32 (the backward torch's).

    Args:
        x: any floating-point tensor.
    """
    if torch.is_grad_enabled() and x.requires_grad:
        return _TorchBackward.apply(x, _sigmoid, _sigmoid_backward)
    return _sigmoid(x)


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


SIGMOIDS = (torch.sigmoid, torch.Tensor.sigmoid, torch.special.expit)  # F.sigmoid calls Tensor.sigmoid


def invariant_function(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The position-invariant version of a functional sigmoid or SiLU call the batch-invariant mode sees; None for
    anything else, and for the calls it leaves to torch (in place, into `out`, not a floating tensor).

    Args:
        func: the function called.
        args, kwargs: its arguments.
    """
    if func not in SIGMOIDS and func is not torch.nn.functional.silu:
        return None
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or kwargs.get("out") is not None:
        return None
    if func is torch.nn.functional.silu:
        return None if kwargs.get("inplace") or args[1:2] == (True,) else invariant_silu(x)
    return invariant_sigmoid(x)
