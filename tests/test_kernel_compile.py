"""The Triton kernels compile for NVIDIA Hopper (sm_90) and Ampere (sm_80) within their shared memory, proved on
the CPU: `triton.compile` for a GPU target needs no GPU, only the ptxas inside the triton wheel.

The variants are those `paged_attention` launches (rollout.benchmarks.kernels.variants), over the pairwise-covering
matrix plus each dtype's largest-resource shape: the full product of the supported inputs is tens of thousands of
variants, hours of compiling on a small machine (`python -m rollout.benchmarks.kernels.compile --matrix full` runs it).
Compiling (rollout.benchmarks.kernels.compile) runs in a subprocess, with TRITON_INTERPRET unset (conftest sets it on
CPU machines, and the interpreter's kernels cannot be compiled) and a fresh TRITON_CACHE_DIR (so that every
variant really compiles), started in the background at the lowest priority once the tests are collected
(tests/kernel_compile_job.py).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import kernel_compile_job
import pytest
import torch

pytest.importorskip("triton")

from rollout.benchmarks.kernels.variants import (  # noqa: E402
    BLOCK_SIZES,
    DTYPES,
    HEAD_DIMS,
    HEADS_PER_KV,
    TARGETS,
    LaunchShape,
    covering_launch_shapes,
    kernel_variants,
    largest_launch_shapes,
    pairwise,
    record_launches,
    specialize,
    split_counts,
    tile_shapes,
)
from rollout.engine.attention.kernel_plan import plan_splits, tile_shape  # noqa: E402


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Every covering variant compiled for every target, once per test session: {variants, seconds, results}. The
    compile starts in the background when the session's tests are collected (kernel_compile_job, conftest)."""
    return kernel_compile_job.result()


def test_ptxas_ships_with_triton():
    """Compiling to a cubin needs ptxas: triton's wheel carries one (TRITON_PTXAS_PATH points elsewhere)."""
    from triton import knobs

    assert Path(knobs.nvidia.ptxas.path).is_file(), "no ptxas: install triton's wheel or set TRITON_PTXAS_PATH"


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_variant_compiles_within_shared_memory(compiled, target):
    """Every covering variant compiles for Hopper; Ampere compiles the largest-resource ones (each dtype's largest
    head dim, block size, tile and split count: where its smaller shared memory is the limit)."""
    results = [result for result in compiled["results"] if result["target"] == target]
    expected = compiled["variants"] if target == "sm_90" else len(kernel_variants(largest_launch_shapes()))
    assert len(results) == expected  # each variant once per target
    errors = [f"{r['label']}: {r['error']}" for r in results if r["error"]]
    assert not errors, "\n".join(errors)
    over = [
        f"{r['label']}: {r['shared']} > {r['shared_limit']} bytes" for r in results if r["shared"] > r["shared_limit"]
    ]
    assert not over, "\n".join(over)


def test_matrix_reaches_every_value_the_planners_pick():
    """The constexpr values come from the planning functions, and the covering matrix holds every one of them
    and every pair of input values."""
    assert split_counts() == (1, 2, 4, 8, 16)  # powers of two up to 16, as plan_splits promises
    assert plan_splits(1, 1, 4096) == 16 and plan_splits(256, 1, 4096) == 1
    for hpk in HEADS_PER_KV:
        tiles = tile_shapes(hpk)
        assert [rows for rows, _ in tiles] == [16, 32, 64] and all(rows == q * hpk for rows, q in tiles)
        assert all(tile_shape(hpk, length) in tiles for length in range(1, 4097, 7))  # longer queries: no new tile
    shapes = covering_launch_shapes()
    axes = {
        "dtype": DTYPES,
        "head_dim": HEAD_DIMS,
        "heads_per_kv": HEADS_PER_KV,
        "block_size": BLOCK_SIZES,
        "num_splits": split_counts(),
        "softcap": (False, True),
        "window": (False, True),
    }
    for (a, values_a), (b, values_b) in itertools.combinations(axes.items(), 2):
        seen = {(getattr(s, a), getattr(s, b)) for s in shapes}
        assert seen == set(itertools.product(values_a, values_b)), (a, b)
    seen_tiles = {(s.heads_per_kv, tile_shape(s.heads_per_kv, s.query_len)) for s in shapes}
    assert seen_tiles == {(hpk, tile) for hpk in HEADS_PER_KV for tile in tile_shapes(hpk)}


def test_recorded_launches_carry_the_planned_constants():
    """A recorded launch's constexprs are what paged_attention derives from the shape (BLOCK_D pads the head dim
    to a power of two; a split launch is followed by the merge)."""
    shape = LaunchShape(torch.bfloat16, 80, 4, 32, 9, 4, True, False)
    attention, merge = (specialize(launch) for launch in record_launches(shape))
    expected = dict(HEADS_PER_KV=4, HEAD_DIM=80, BLOCK_M=64, BLOCK_Q=16, BLOCK_N=32, BLOCK_D=128, NUM_SPLITS=4)
    assert {key: attention.constexprs[key] for key in expected} == expected
    assert attention.constexprs["USE_SOFTCAP"] and not attention.constexprs["USE_WINDOW"]
    assert merge.kernel == "_merge_splits_kernel" and merge.constexprs["NUM_SPLITS"] == 4
    assert attention.signature["q_ptr"] == "*bf16" and attention.signature["stride_bt"] == "i32"


def test_pairwise_covers_every_pair():
    sizes = [3, 5, 2, 4]
    rows = pairwise(sizes)
    for i, j in itertools.combinations(range(len(sizes)), 2):
        assert {(row[i], row[j]) for row in rows} == set(itertools.product(range(sizes[i]), range(sizes[j])))
    assert len(rows) < 3 * 5 * 2 * 4 // 4  # far fewer than the product


WIDE_BLOCKS = """
import json, torch
from rollout.benchmarks.kernels.compile import compile_variant
from rollout.benchmarks.kernels.variants import LaunchShape, kernel_variants
shapes = [LaunchShape(torch.bfloat16, 256, 1, 256, 64, 1, False, False), LaunchShape(torch.float16, 128, 4, 128, 16, 1, True, True)]
results = [compile_variant(variant, target) for variant in kernel_variants(shapes) for target in ("sm_90", "sm_80")]
print(json.dumps([[r.label, r.target, r.shared, r.shared_limit, r.error] for r in results]))
"""


def test_cache_blocks_wider_than_a_key_tile_compile_within_shared_memory(tmp_path):
    """block_size 128 and 256 (powers of two >= 16: the engine picks the Triton kernel for them) are read 64 keys
    at a time, as 64-token blocks are: a whole 256-token block of 256-wide bf16 keys and values per product asked
    for 557 KB of shared memory, over any GPU's (the first step failed on an H100)."""
    from conftest import compile_for_gpus

    results = compile_for_gpus(WIDE_BLOCKS, tmp_path)
    assert len(results) == 4
    for label, target, shared, limit, error in results:
        assert error is None and shared <= limit, (label, target, shared, limit, error)
