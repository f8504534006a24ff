"""`invariant_matmul` on a GPU: a Triton kernel whose every output row is computed the same way whatever the others.

Each program computes one (BLOCK_M, BLOCK_N) tile of `x @ w.T`, walking the reduction in BLOCK_K steps in order and
accumulating in fp32; the tile sizes are constants (never chosen by the matrix's shape, never autotuned) and the
reduction is never split across programs. So a row's result depends on its own values and the weights only: not on
the number of rows, their order, or the GPU's occupancy. (cuBLAS picks its kernel, and sometimes a split of the
reduction, by shape: its rows are not invariant.) The number of rows is never specialized (one row would compile
another kernel for a decode step than for a prefill); the other arguments are the layer's shape, the same in every
process, and the tensor cores' product does not follow the loads' layouts (compiled for sm_90: one wgmma
16x64x16 for one row, 17 rows or unaligned rows). Runs in Triton's interpreter on CPU tensors for the tests.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
NUM_WARPS = 4
# In Triton's interpreter (tests only), tl.dot is numpy's matmul: it multiplies bf16 tiles wrongly, and its BLAS
# rounds a row by its place in the tile (OpenBLAS 0.3.31: a row alone and the same row 64th of a tile differ in fp32).
# There the products are summed over k in order, element by element (IN_ORDER): each row's own arithmetic, so the
# interpreter checks the kernels' tiles, masks and order of blocks. Compiled, the branch is not there.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=("rows",))
def invariant_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows,
    cols,
    depth,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IN_ORDER: tl.constexpr,
):
    """out[rows, cols] = x[rows, depth] @ w[cols, depth].T, one fixed tile per program, fp32 accumulation."""
    # int64: rows x columns (a head's logits: 14k rows of a 152k vocabulary) and columns x depth may pass 2**31
    row = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    col = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offsets = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, depth, BLOCK_K):
        k = (start + offsets).to(tl.int64)
        x = tl.load(
            x_ptr + row[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=(row[:, None] < rows) & (k[None, :] < depth),
            other=0.0,
        )
        w = tl.load(
            w_ptr + col[None, :] * stride_wn + k[:, None] * stride_wk,
            mask=(col[None, :] < cols) & (k[:, None] < depth),
            other=0.0,
        )
        if IN_ORDER:  # the interpreter's (module constant _INTERPRETED)
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    tl.store(
        out_ptr + row[:, None] * stride_om + col[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=(row[:, None] < rows) & (col[None, :] < cols),
    )


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` for 2-D `x` (rows, in_features) and `weight` (out_features, in_features), in `x`'s dtype,
    batch-invariant (module docstring).

    Args:
        x: the rows, on the GPU (or on the CPU inside Triton's interpreter).
        weight: the weight matrix, on the same device and of the same dtype.
    Returns:
        (rows, out_features).
    """
    rows, depth = x.shape
    cols = weight.shape[0]
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(cols, BLOCK_N))
    invariant_matmul_kernel[grid](
        x,
        weight,
        out,
        rows,
        cols,
        depth,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 models keep fp32 products
        IN_ORDER=_INTERPRETED,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )
    return out
