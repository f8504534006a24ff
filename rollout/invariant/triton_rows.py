"""Row reductions on a GPU that give each row the same bits whatever the other rows: a mean over the last axis (the
RMSNorm's) and a log_softmax over the last axis (the log-probs').

torch's CUDA reductions choose how many threads and blocks share one row's sum from the tensor's shape (a few rows
get a row split across many threads, many rows one warp each), and its softmax picks a variant by the pointer's
alignment: a row's result then depends on what else is in the call. Here one program reduces one row, walking it in
`BLOCK` columns at a time into a `BLOCK`-wide fp32 accumulator and summing that in one fixed tree at the end: the
order depends on the row's length alone. Every call runs one compiled kernel (per dtype): the tree `tl.sum` adds in
follows the layout the compiler picks for the accumulator, which follows what it may assume of the arguments (a
16-byte-aligned row gave 4 columns per thread, an unaligned one 1, compiled for sm_90), so no argument is specialized
(as in triton_attention.py). Runs in Triton's interpreter on CPU tensors for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
NUM_WARPS = 4
# Never specialized (module docstring): one kernel per dtype whatever the row's alignment and length.
POINTERS = ("x_ptr", "out_ptr")
# No multiply-add contraction: Triton compiles a kernel per argument specialization (alignment, sizes of 1), and each
# must round every operation alike (the same in triton_matmul.py and triton_attention.py).
LAUNCH = {"num_warps": NUM_WARPS, "enable_fp_fusion": False}


@triton.jit(do_not_specialize=("columns", "stride_row"), do_not_specialize_on_alignment=POINTERS)
def row_mean_kernel(x_ptr, out_ptr, columns: tl.int64, stride_row: tl.int64, BLOCK: tl.constexpr):
    """out[row] = mean(x[row, :columns]), accumulated in fp32."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, columns, BLOCK):
        index = start + offsets
        acc += tl.load(x_ptr + row * stride_row + index, mask=index < columns, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + row, (total / columns).to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=("columns", "stride_row", "stride_out"), do_not_specialize_on_alignment=POINTERS)
def row_log_softmax_kernel(
    x_ptr, out_ptr, columns: tl.int64, stride_row: tl.int64, stride_out: tl.int64, BLOCK: tl.constexpr
):
    """out[row] = x[row] - logsumexp(x[row]), in fp32 (stored in out's dtype); three passes over the row."""
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    peak = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for start in range(0, columns, BLOCK):
        index = start + offsets
        values = tl.load(x_ptr + row * stride_row + index, mask=index < columns, other=float("-inf"))
        peak = tl.maximum(peak, values.to(tl.float32))
    top = tl.max(peak, axis=0)  # a maximum is exact in any order
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, columns, BLOCK):
        index = start + offsets
        values = tl.load(x_ptr + row * stride_row + index, mask=index < columns, other=float("-inf"))
        acc += tl.exp(values.to(tl.float32) - top)
    log_total = tl.log(tl.sum(acc, axis=0))
    for start in range(0, columns, BLOCK):
        index = start + offsets
        values = tl.load(x_ptr + row * stride_row + index, mask=index < columns, other=0.0)
        shifted = (values.to(tl.float32) - top) - log_total
        tl.store(out_ptr + row * stride_out + index, shifted.to(out_ptr.dtype.element_ty), mask=index < columns)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as contiguous (rows, last axis)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean of `x` over its last axis (the axis dropped), in `x`'s dtype, each row reduced alone.

    Args:
        x: a floating tensor on the GPU (or on the CPU inside Triton's interpreter), with a non-empty last axis.
    Returns:
        x.shape[:-1].
    """
    rows = _rows(x)
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        row_mean_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK=BLOCK, **LAUNCH)
    return out.view(x.shape[:-1])


def row_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """`torch.log_softmax(x, -1)` computed in fp32, in `x`'s dtype, each row reduced alone.

    Args:
        x: a floating tensor on the GPU (or on the CPU inside Triton's interpreter).
    Returns:
        x.shape.
    """
    rows = _rows(x)
    out = torch.empty_like(rows)
    if rows.numel():
        row_log_softmax_kernel[(rows.shape[0],)](
            rows, out, rows.shape[1], rows.stride(0), out.stride(0), BLOCK=BLOCK, **LAUNCH
        )
    return out.view(x.shape)
