"""`invariant_linear`: `F.linear` whose every output row is computed the same way whatever the other rows are.

torch's CPU matmul picks its kernel and its split of the reduction by the matrix's shape and the thread count, so a
row's result can depend on how many rows share the call (measured: up to 2e-6 in fp32 between 1 and 300 rows, and
0.25 in bf16). What was measured to hold (MKL / oneDNN on three machines, 1 to 32 threads, 4 to 4096 rows): in
fp32, a reduction of at most `K_CHUNK` is summed in one order whatever the numbers of columns and threads, as long
as the rows are a multiple of a bound of the machine's, `MIN_ROWS` (other counts may take other kernels for some
rows: matrix-vector, small-matrix, or a thread's remainder). So in fp32 every row takes part in one matmul per
`K_CHUNK`-wide slice of the reduction, zero rows added up to a multiple of `MIN_ROWS`, and the slices' products are
added in order. Lower precisions are reduced in one call per tile of `ROW_TILE` rows (the last one padded with
zeros), each tile a matmul of the same shape, which accumulates in fp32 inside the kernel as a plain `F.linear`
does. On a GPU the same promise is kept by one Triton kernel of fixed tiles (`triton_matmul.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.invariant.reductions import on_kernel_device

ROW_TILE = 16
K_CHUNK = 256
# fp32 products have a multiple of `MIN_ROWS` rows (zero rows added): fewer take other kernels (matrix-vector,
# small-matrix), and other counts are split among threads with a remainder that does (on an AMD EPYC, 1-3 rows with
# one thread, 5-7 and 9-11 with two, 17-19 and 25-27 with sixteen summed otherwise). Multiples of 4 from 4 to 1,024
# rows gave one thread's bits with 1 to 32 threads there, for the linears' products and the attention's; an Intel
# Xeon with AVX-512 FP16 (Sapphire Rapids) summed 4 and 8 rows of a 256-long reduction otherwise, 16 held. So the
# bound is the machine's: `cpu_check.check_cpu_products` raises `MIN_ROWS` to the first of `ROW_MULTIPLES` under
# which the model's products hold here (each candidate a multiple of the one before, so a bound raised for one
# model holds for the models checked under a smaller one). It is never lowered; its rows' bits are the same under
# any bound that holds (those of the products among many rows), so two processes that chose different bounds agree.
ROW_MULTIPLES = (4, 8, 16, 32)
MIN_ROWS = ROW_MULTIPLES[0]  # the row multiple in use in this process


def tiled_matmul(rows: torch.Tensor, weight: torch.Tensor, row_multiple: int | None = None) -> torch.Tensor:
    """`rows @ weight.t()` for 2-D `rows`, row-invariant (module docstring).

    Args:
        rows: (count, in_features).
        weight: (out_features, in_features).
        row_multiple: fp32 rows are padded to a multiple of this (default `MIN_ROWS`, the one in use; the check
            tries others).
    """
    count, features = rows.shape
    if count == 0:  # a step that keeps no row's logits
        return rows.new_empty(0, weight.shape[0])
    if on_kernel_device(rows):  # one fixed-tile Triton kernel (triton_matmul.py): cuBLAS picks kernels by shape
        from rollout.invariant.triton_matmul import invariant_matmul

        return invariant_matmul(rows, weight)
    transposed = weight.t()
    if rows.dtype == torch.float32:
        multiple = MIN_ROWS if row_multiple is None else row_multiple
        padded = torch.nn.functional.pad(rows, (0, 0, 0, (-count) % multiple)) if count % multiple else rows
        out = torch.mm(padded[:, :K_CHUNK], transposed[:K_CHUNK])
        for start in range(K_CHUNK, features, K_CHUNK):
            out.add_(torch.mm(padded[:, start : start + K_CHUNK], transposed[start : start + K_CHUNK]))
        return out[:count]
    padded = torch.nn.functional.pad(rows, (0, 0, 0, (-count) % ROW_TILE))
    tiles = [torch.mm(padded[first : first + ROW_TILE], transposed) for first in range(0, padded.shape[0], ROW_TILE)]
    return torch.cat(tiles)[:count]


class InvariantLinear(torch.autograd.Function):
    """The tiled forward; an ordinary backward (one matmul per gradient: the backward need not be invariant)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)  # in the dtype the forward computed in (autocast's, cast before)
        # Detached: `tiled_matmul` returns a view (its padded rows sliced), and autograd refuses an in-place change
        # of a custom Function's output that is a view (OLMo's `q_proj(x).clamp_()` under clip_qkv), which
        # F.linear's output takes.
        return tiled_matmul(rows, weight).detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        rows, weight = ctx.saved_tensors
        with torch._C.DisableTorchFunction():  # ordinary products, not the mode's (`invariant_product`)
            grad_rows = grad @ weight if ctx.needs_input_grad[0] else None
            grad_weight = grad.t() @ rows if ctx.needs_input_grad[1] else None
        return grad_rows, grad_weight


def invariant_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002 - F.linear's own keyword
    """`F.linear(input, weight, bias)`, batch-invariant in the forward (differentiable; the backward is ordinary).
    Under autocast, computed in autocast's dtype, as `F.linear` is.

    Args:
        input: (..., in_features).
        weight: (out_features, in_features).
        bias: (out_features,) or None.
    Returns:
        (..., out_features), in the computing dtype.
    """
    x = input
    device = x.device.type
    if torch.is_autocast_enabled(device):  # cast here, so the backward sees the dtypes the forward multiplied
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    rows = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad):
        out = InvariantLinear.apply(rows, weight)
    else:
        out = tiled_matmul(rows, weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


# The matrix products an MoE model's eager experts write as `tokens @ weight` (Aria's, Ergo's) rather than `F.linear`.
# Not `torch.mm`: `tiled_matmul`'s own products are that, called under the mode from a swapped linear.
MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


def invariant_product(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """`rows @ weight` as `invariant_linear(rows, weight.mT)` when the batch-invariant mode sees a matrix product by a
    2-D weight (the rows' count varies with the batch: an expert's tokens); None for anything else (a batched product,
    as the eager attention's scores, or one into `out`), which runs as it is.

    Args:
        func: the function called.
        args, kwargs: its arguments.
    """
    if func not in MATMULS or len(args) != 2 or kwargs:
        return None
    rows, weight = args
    if not (isinstance(rows, torch.Tensor) and isinstance(weight, torch.Tensor)) or weight.dim() != 2:
        return None
    if rows.dim() < 1 or rows.shape[-1] != weight.shape[0] or not rows.is_floating_point():
        return None  # torch's own error, or an integer product
    if rows.dtype != weight.dtype and not torch.is_autocast_enabled(rows.device.type):
        return None  # torch's own error
    return invariant_linear(rows, weight.mT)
