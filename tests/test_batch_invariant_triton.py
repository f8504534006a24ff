"""The GPU half of `rollout.invariant`'s matmul (`triton_matmul.invariant_matmul`), run in Triton's interpreter on
the CPU: each output row is the same bits whatever the number of rows and the row's place among them, in fp32 and
bf16, and close to torch's own matmul; and the kernel compiles for sm_90 (Hopper) and sm_80 with Triton's ptxas,
without a GPU."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import compile_for_gpus, needs_triton_interpreter
from rollout.invariant.triton_matmul import invariant_matmul


@needs_triton_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_row_is_the_same_bits_whatever_the_others(dtype):
    torch.manual_seed(0)
    weight, x = (torch.randn(96, 80) / 9).to(dtype), torch.randn(150, 80).to(dtype)
    alone = invariant_matmul(x[:1], weight)
    for count in (2, 65, 150):  # one tile of rows, two, three
        assert torch.equal(invariant_matmul(x[:count], weight)[:1], alone)
        assert torch.equal(invariant_matmul(torch.cat([x[1:count], x[:1]]), weight)[-1:], alone)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        invariant_matmul(x, weight).float(), x.float() @ weight.float().T, atol=tolerance, rtol=tolerance
    )
    assert invariant_matmul(x[:0], weight).shape == (0, 96)


COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rollout.invariant import triton_matmul as tm
results = []
for dtype, precision in (("bf16", "tf32"), ("fp16", "tf32"), ("fp32", "ieee")):
    signature = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
    signature.update({name: "i32" for name in ("rows", "cols", "depth", "stride_xm", "stride_xk", "stride_wn",
                                               "stride_wk", "stride_om", "stride_on")})
    constants = {"BLOCK_M": tm.BLOCK_M, "BLOCK_N": tm.BLOCK_N, "BLOCK_K": tm.BLOCK_K, "DOT_PRECISION": precision,
                 "IN_ORDER": False}
    signature.update({name: "constexpr" for name in constants})
    for arch in (90, 80):
        source = ASTSource(tm.invariant_matmul_kernel, signature, constants)
        options = {"num_warps": tm.NUM_WARPS, "enable_fp_fusion": False}
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        # Every address offset in 64 bits: rows x columns (a head's logits) and columns x depth may pass 2**31.
        offsets = [line.split(":")[-1] for line in compiled.asm["ttir"].splitlines() if "tt.addptr" in line]
        wide = bool(offsets) and all("xi64>" in kind.split(",")[-1] for kind in offsets)
        results.append([dtype, arch, compiled.metadata.shared, "cubin" in compiled.asm, wide])
print(json.dumps(results))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's ptxas ships for Linux")
def test_the_kernel_compiles_for_hopper_and_ampere(tmp_path):
    results = compile_for_gpus(COMPILE, tmp_path)
    assert sorted((dtype, arch) for dtype, arch, *_ in results) == sorted(
        (dtype, arch) for dtype in ("bf16", "fp16", "fp32") for arch in (80, 90)
    )
    for dtype, arch, shared, has_cubin, wide_offsets in results:
        assert has_cubin and 0 < shared <= 166912 and wide_offsets, (dtype, arch, shared, wide_offsets)
