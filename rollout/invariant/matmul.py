"""`invariant_linear`: `F.linear` whose every output row is computed the same way whatever the other rows are.

torch's CPU matmul picks its kernel and its split of the reduction by the matrix's shape and the thread count, so a
row's result depends on how many rows share the call (measured: up to 2e-6 in fp32 between 1 and 300 rows). Here
the rows are cut into tiles of `ROW_TILE` (the last one padded with zeros) and each tile is one matmul of the same
shape; a row's result depends on its own values only, not on its place in the tile (a GEMM computes each output
element from its row and column alone). In fp32 the reduction is also cut into chunks of `K_CHUNK` summed in order,
since a long fp32 reduction is split across threads (measured at K >= 1024 between 1 and 2 threads); lower precisions
reduce in one call per tile, accumulating in fp32 inside the kernel, as a plain `F.linear` does. On a GPU the same
promise is kept by one Triton kernel of fixed tiles (`triton_matmul.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.invariant.reductions import on_kernel_device

ROW_TILE = 16
K_CHUNK = 256


def tiled_matmul(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rows @ weight.t()` for 2-D `rows`, tile by tile (module docstring)."""
    count, features = rows.shape
    if count == 0:  # a step that keeps no row's logits
        return rows.new_empty(0, weight.shape[0])
    if on_kernel_device(rows):  # one fixed-tile Triton kernel (triton_matmul.py): cuBLAS picks kernels by shape
        from rollout.invariant.triton_matmul import invariant_matmul

        return invariant_matmul(rows, weight)
    padded = torch.nn.functional.pad(rows, (0, 0, 0, (-count) % ROW_TILE))
    transposed = weight.t()
    chunked = rows.dtype == torch.float32 and features > K_CHUNK
    tiles = []
    for first in range(0, padded.shape[0], ROW_TILE):
        tile = padded[first : first + ROW_TILE]
        if chunked:
            out = torch.mm(tile[:, :K_CHUNK], transposed[:K_CHUNK])
            for start in range(K_CHUNK, features, K_CHUNK):
                out = out + torch.mm(tile[:, start : start + K_CHUNK], transposed[start : start + K_CHUNK])
        else:
            out = torch.mm(tile, transposed)
        tiles.append(out)
    return torch.cat(tiles)[:count]


class InvariantLinear(torch.autograd.Function):
    """The tiled forward; an ordinary backward (one matmul per gradient: the backward need not be invariant)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)  # in the dtype the forward computed in (autocast's, cast before)
        return tiled_matmul(rows, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        rows, weight = ctx.saved_tensors
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
