"""The batch-invariant attention kernel (`rollout.invariant.triton_attention`) fits the shared memory of Hopper
(sm_90) and Ampere (sm_80) for every dtype and head dim it is launched with: the launch `attend_invariant_triton`
makes is recorded on the CPU, then compiled as launched (its options included) with Triton's ptxas, without a GPU."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import compile_for_gpus
from rollout.invariant import triton_attention
from rollout.invariant.attention import KEY_BLOCK, QUERY_TILE

SHARED_LIMITS = {90: 232448, 80: 166912}  # bytes a block may opt into (CUDA programming guide, 9.0 and 8.0)

COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rollout.invariant import triton_attention as ta
launches = json.loads({launches!r})
results = []
for dtype, constants, options in launches:
    pointers = {{"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "table_ptr": "i64", "allowed_ptr": "u8",
                "start_ptr": "i64", "end_ptr": "i64", "out_ptr": dtype}}
    kinds = {{**{{name: "*" + kind for name, kind in pointers.items()}}, "scaling": "fp32", "softcap": "fp32",
             **{{name: "constexpr" for name in constants}}}}
    signature = {{name: kinds.get(name, "i64") for name in ta.invariant_attention_kernel.arg_names}}
    for arch in (90, 80):
        compiled = triton.compile(ASTSource(ta.invariant_attention_kernel, signature, constants),
                                  target=GPUTarget("cuda", arch, 32), options=options)
        results.append([dtype, constants["HEAD_DIM"], arch, compiled.metadata.shared])
print(json.dumps(results))
"""


def _launch(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, head_dim: int) -> list:
    """[Triton dtype, constexprs, options] of the kernel launch for a (1, 2, 3, head_dim) attention (not run)."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(triton_attention, "invariant_attention_kernel", Recorder())
    query, key = torch.zeros(1, 2, 3, head_dim, dtype=dtype), torch.zeros(1, 1, 3, head_dim, dtype=dtype)
    allowed = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    triton_attention.attend_invariant_triton(query, key, key, allowed, None, 0.1, 30.0, QUERY_TILE, KEY_BLOCK)
    (kwargs,) = launches
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages", "enable_fp_fusion") if name in kwargs}
    kwargs["IN_ORDER"] = False  # compiled, not interpreted
    return [{torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype], kwargs, options]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Triton's ptxas ships for Linux")
def test_the_widest_heads_fit_ampere_and_hopper(monkeypatch, tmp_path):
    """fp32 and bf16 at head dim 256 (Gemma 2's, the widest tile): software-pipelined, the fp32 tile held 218 KB of
    shared memory, over an A100's 163 KB."""
    launches = [_launch(monkeypatch, dtype, 256) for dtype in (torch.float32, torch.bfloat16)]
    results = compile_for_gpus(COMPILE.format(launches=json.dumps(launches)), tmp_path)
    assert len(results) == 4
    for dtype, head_dim, arch, shared in results:
        assert 0 < shared <= SHARED_LIMITS[arch], (dtype, head_dim, arch, shared)
