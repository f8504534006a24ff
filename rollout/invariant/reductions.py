"""`invariant_mean` and `invariant_log_softmax`: the last-axis reductions of a forward (an RMSNorm's mean of squares,
the log-probs' log_softmax), each row computed the same way whatever else is in the tensor.

On a GPU they run `triton_rows.py`'s kernels (torch's CUDA reductions split a row by the tensor's shape); on the CPU
torch's own, whose per-row reduction does not depend on the row count (measured through the engine's CPU tests). The
backward is the ordinary one (correct, not itself invariant), as for `invariant_linear`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# Tests only: with Triton's interpreter on, CPU tensors take the GPU kernels too (the GPU's arithmetic, on a CPU).
KERNELS_ON_CPU = os.environ.get("ROLLOUT_INVARIANT_KERNELS_ON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1"


# The kernels accumulate in fp32: a float64 tensor keeps torch's own (float64) reductions.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def on_kernel_device(x: torch.Tensor) -> bool:
    """Whether `x` takes the Triton kernels: an fp32/bf16/fp16 CUDA tensor (or a CPU one, with `KERNELS_ON_CPU`)."""
    return (x.is_cuda or (KERNELS_ON_CPU and x.device.type == "cpu")) and x.dtype in KERNEL_DTYPES


def row_mean(x: torch.Tensor) -> torch.Tensor:
    from rollout.invariant import triton_rows  # Triton only where there is a GPU

    return triton_rows.row_mean(x)


def row_log_softmax(x: torch.Tensor) -> torch.Tensor:
    from rollout.invariant import triton_rows

    return triton_rows.row_log_softmax(x)


class _RowMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        return row_mean(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return (grad.unsqueeze(-1) / ctx.shape[-1]).expand(ctx.shape)


class _RowLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = row_log_softmax(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        return torch._log_softmax_backward_data(grad, out, -1, out.dtype)


def _differentiable(function: type[torch.autograd.Function], kernel: Any, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return function.apply(x)
    return kernel(x)


def invariant_mean(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """`x.mean(-1, keepdim)`, each row reduced alone on a GPU (module docstring).

    Args:
        x: a floating tensor.
        keepdim: keep the reduced axis (as size 1).
    Returns:
        The mean over the last axis, in `x`'s dtype.
    """
    if not on_kernel_device(x):
        return x.mean(-1, keepdim=keepdim)
    out = _differentiable(_RowMean, row_mean, x)
    return out.unsqueeze(-1) if keepdim else out


def invariant_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """`torch.log_softmax(x, -1)`, each row reduced alone on a GPU (module docstring).

    Args:
        x: a floating tensor.
    Returns:
        Log-probabilities over the last axis, in `x`'s dtype.
    """
    if not on_kernel_device(x):
        return torch.log_softmax(x, dim=-1)
    return _differentiable(_RowLogSoftmax, row_log_softmax, x)


def _last_axis(dim: Any, ndim: int) -> bool:
    """Whether `dim` names the last axis alone (an int or a one-element sequence)."""
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, ndim - 1)


MEANS = (torch.mean, torch.Tensor.mean)
# The positional arguments after the input, by function (only `dim`, `keepdim` and `dtype` are read).
POSITIONAL = {
    torch.mean: ("dim", "keepdim"),
    torch.Tensor.mean: ("dim", "keepdim"),
    torch.log_softmax: ("dim", "dtype"),
    torch.Tensor.log_softmax: ("dim", "dtype"),
    torch.special.log_softmax: ("dim", "dtype"),
    torch.nn.functional.log_softmax: ("dim", "_stacklevel", "dtype"),
}


def invariant_reduction(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The invariant version of a `torch` call the batch-invariant mode sees, when it is a last-axis mean or
    log_softmax of a CUDA tensor with no dtype argument; None for anything else (run as it is).

    Args:
        func: the function called (`torch.mean`, `Tensor.mean`, `torch.log_softmax`, `F.log_softmax`, ...).
        args, kwargs: its arguments.
    """
    names = POSITIONAL.get(func)
    if names is None:
        return None
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or not on_kernel_device(x) or x.ndim == 0 or x.shape[-1] == 0:
        return None
    if kwargs.get("out") is not None:  # torch writes into `out`: left to it
        return None
    given = {**dict(zip(names, args[1:])), **kwargs}
    if given.get("dtype") is not None or not _last_axis(given.get("dim"), x.ndim):
        return None
    if func in MEANS:
        return invariant_mean(x, keepdim=bool(given.get("keepdim", False)))
    return invariant_log_softmax(x)
