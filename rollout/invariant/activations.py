"""Activation functions whose value for an element does not depend on where the element sits in its tensor.

torch's CPU kernels for SiLU, sigmoid, GELU (tanh and erf), softplus and Mish run a SIMD loop and send the elements
left over at the end of each thread's share through a scalar loop that rounds differently: a row's bits then depend
on the tensor's size and the thread count (measured: a width of 300 at 1-5 threads, 3072 at 5, 11008 at 3; the erf
GELU of one element, softplus of 7-1001). `exp`, `log1p`, `tanh`, `erf` and the four arithmetic operations give every
element the same bits wherever it sits (1-3 threads, 1-11008 elements, fp32 and bf16), so these are written with
them, in fp32, and cast back to the input's dtype as torch's kernels do. `swaps.py` runs a model's activation modules
through them, and `InvariantLinearMode` (mode.py) the functional calls a module swap cannot see (Qwen2-MoE's
shared-expert gate, sigmoid routers, Laguna's softplus gate, an activation module behind accelerate's hooks):
`invariant_function`.

The backward of SiLU, sigmoid, softplus and Mish is torch's own (`silu_backward`, `sigmoid_backward`,
`softplus_backward`, `mish_backward`): the formulas' own autograd gives NaN where `exp` overflows (inf / inf), where
torch's gives 0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

GELU_TANH_SCALE = math.sqrt(2 / math.pi)
INVERSE_SQRT2 = 1 / math.sqrt(2)


def _silu(x: torch.Tensor) -> torch.Tensor:
    y = x.float()
    return (y / (1 + torch.exp(-y))).to(x.dtype)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return (1 / (1 + torch.exp(-x.float()))).to(x.dtype)


def _silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.silu_backward(grad, x)


def _sigmoid_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.sigmoid_backward(grad, torch.sigmoid(x))


def _softplus(x: torch.Tensor, beta: float, threshold: float) -> torch.Tensor:
    y = x.float()
    scaled = y * beta
    return torch.where(scaled > threshold, y, torch.log1p(torch.exp(scaled)) / beta).to(x.dtype)


def _softplus_backward(grad: torch.Tensor, x: torch.Tensor, beta: float, threshold: float) -> torch.Tensor:
    return torch.ops.aten.softplus_backward(grad, x, beta, threshold)


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


def _with_torchs_backward(x: torch.Tensor, forward: Callable, backward: Callable) -> torch.Tensor:
    """`forward(x)`, differentiated with `backward` (torch's own) when autograd records it."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _TorchBackward.apply(x, forward, backward)
    return forward(x)


def invariant_silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), as x / (1 + exp(-x)) in fp32 (the backward torch's).

    Args:
        x: any floating-point tensor.
    """
    return _with_torchs_backward(x, _silu, _silu_backward)


def invariant_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x), as 1 / (1 + exp(-x)) in fp32 (the backward torch's).

    Args:
        x: any floating-point tensor.
    """
    return _with_torchs_backward(x, _sigmoid, _sigmoid_backward)


def invariant_softplus(x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
    """softplus(x) = log(1 + exp(beta x)) / beta, x itself where beta x > threshold (torch's), with `log1p` and `exp`
    in fp32 (the backward torch's).

    Args:
        x: any floating-point tensor.
        beta, threshold: as `F.softplus`'s.
    """
    forward = functools.partial(_softplus, beta=beta, threshold=threshold)
    return _with_torchs_backward(x, forward, functools.partial(_softplus_backward, beta=beta, threshold=threshold))


def _mish(x: torch.Tensor) -> torch.Tensor:
    y = x.float()
    return (y * torch.tanh(_softplus(y, 1.0, 20.0))).to(x.dtype)


def _mish_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.mish_backward(grad, x)


def invariant_mish(x: torch.Tensor) -> torch.Tensor:
    """Mish, x tanh(softplus(x)), in fp32 (the backward torch's).

    Args:
        x: any floating-point tensor.
    """
    return _with_torchs_backward(x, _mish, _mish_backward)


def invariant_gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """GELU, 0.5 x (1 + erf(x / sqrt(2))), in fp32.

    Args:
        x: any floating-point tensor.
    """
    y = x.float()
    return (0.5 * y * (1 + torch.erf(y * INVERSE_SQRT2))).to(x.dtype)


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

    table: dict[type, Callable[[torch.Tensor], torch.Tensor]] = {
        torch.nn.SiLU: invariant_silu,
        torch.nn.Mish: invariant_mish,
    }
    named = (
        ("SiLUActivation", invariant_silu),
        ("GELUTanh", invariant_gelu_tanh),
        ("GELUActivation", invariant_gelu_erf),
        ("MishActivation", invariant_mish),
    )
    for name, function in named:
        cls = getattr(activations, name, None)
        if cls is not None:
            table[cls] = function
    return table


def invariant_activation(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The position-invariant function that computes what `module` does (None: none here; it runs as it is).

    Args:
        module: an activation module (transformers' `ACT2FN` entries: SiLU, GELU, tanh-GELU, Mish; `nn.GELU`).
    """
    if isinstance(module, torch.nn.GELU):
        return invariant_gelu_tanh if module.approximate == "tanh" else invariant_gelu_erf
    return _by_class().get(type(module))


SIGMOIDS = (torch.sigmoid, torch.Tensor.sigmoid, torch.special.expit)  # F.sigmoid calls Tensor.sigmoid


GELUS = {"none": invariant_gelu_erf, "tanh": invariant_gelu_tanh}  # by F.gelu's `approximate`


def _argument(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def invariant_function(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The position-invariant version of a functional sigmoid, SiLU, GELU, softplus or Mish call the batch-invariant
    mode sees; None for anything else, and for the calls it leaves to torch (in place, into `out`, not a floating
    tensor).

    Args:
        func: the function called.
        args, kwargs: its arguments.
    """
    if func not in SIGMOIDS and func not in (F.silu, F.gelu, F.softplus, F.mish):
        return None
    x = _argument(args, kwargs, 0, "input", None)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or kwargs.get("out") is not None:
        return None
    if func in (F.silu, F.mish):
        function = invariant_silu if func is F.silu else invariant_mish
        return None if _argument(args, kwargs, 1, "inplace", False) else function(x)
    if func is F.gelu:
        gelu = GELUS.get(_argument(args, kwargs, 1, "approximate", "none"))
        return None if gelu is None else gelu(x)
    if func is F.softplus:
        return invariant_softplus(
            x, _argument(args, kwargs, 1, "beta", 1.0), _argument(args, kwargs, 2, "threshold", 20.0)
        )
    return invariant_sigmoid(x)
