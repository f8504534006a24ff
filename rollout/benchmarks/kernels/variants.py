"""The Triton kernel variants the engine can launch (compiling them for a GPU target without a GPU is
`kernel_compile.py`).

Triton compiles one binary per distinct specialization of a kernel's arguments: each constexpr value, and whether
plain ints and pointers are 1 or divisible by 16. The launches come from the planning functions (`tile_shape`,
`plan_splits`) and from `paged_attention` itself, run with its kernels swapped for recorders; a launch becomes its
variant through Triton's own binder and cache key (what `JITFunction.run` uses), and compiles for sm_90 / sm_80
with `triton.compile(ASTSource(...), target=GPUTarget(...))`: no GPU, only the ptxas inside the triton wheel.

Relies on Triton internals (`create_function_from_signature`, `compute_cache_key`, `JITFunction._pack_args`) of
triton 3.9. Compiling needs real JITFunctions: run it with TRITON_INTERPRET unset (`python -m
rollout.benchmarks.kernels.variants`, as tests/test_kernel_compile.py does in a subprocess).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

from rollout.engine.attention import triton_kernel as triton_attention
from rollout.engine.attention.kernel_plan import Tiling, plan, plan_splits, tile_shape
from rollout.engine.attention.triton_kernel import paged_attention

KERNELS = ("_paged_attention_kernel", "_merge_splits_kernel")
LAUNCH_OPTIONS = ("num_warps", "num_stages")  # compile options a launch may pass beside its arguments
# What the engine serves: head dims of real models (BLOCK_D pads 80 and 96 to 128), parameter dtypes, power-of-two
# cache block sizes >= 16 (config default 16), and query heads per KV head (MHA 1 up to GQA 16).
HEAD_DIMS = (64, 80, 96, 128, 256)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_SIZES = (16, 32, 64)
HEADS_PER_KV = (1, 2, 4, 8, 16)
WINDOW = 4096  # a real model's sliding window: Triton specializes ints divisible by 16, as real windows are
# Shared memory a block may opt into, in bytes (CUDA programming guide, compute capabilities 9.0 and 8.0).
TARGETS = {"sm_90": (GPUTarget("cuda", 90, 32), 232448), "sm_80": (GPUTarget("cuda", 80, 32), 166912)}


def tile_shapes(heads_per_kv: int) -> dict[tuple[int, int], int]:
    """Every (BLOCK_M, BLOCK_Q) `tile_shape` picks for `heads_per_kv`, with the shortest query length that picks it.
    Tiles stop growing at 64 rows (64 tokens at most), so longer queries pick nothing new.

    Args:
        heads_per_kv: query heads per KV head.
    """
    tiles: dict[tuple[int, int], int] = {}
    for query_len in range(1, 129):
        tiles.setdefault(tile_shape(heads_per_kv, query_len), query_len)
    return tiles


@functools.cache
def split_counts() -> tuple[int, ...]:
    """Every NUM_SPLITS `plan_splits` returns: it is 1 from 256 programs (tiles x KV heads) on, and its slices
    cover at least 8 blocks each, so these ranges reach every value it can return."""
    programs = itertools.product(range(1, 65), (1, 2, 4, 8), range(1, 257))  # tiles, KV heads, blocks
    return tuple(sorted({plan_splits(tiles, kv_heads, blocks) for tiles, kv_heads, blocks in programs}))


@dataclass(frozen=True)
class LaunchShape:
    """The inputs of one `paged_attention` call that select its kernels' compile-time constants."""

    dtype: torch.dtype
    head_dim: int
    heads_per_kv: int
    block_size: int
    query_len: int  # the step's longest query: picks the tile
    num_splits: int
    softcap: bool
    window: bool


def all_launch_shapes() -> list[LaunchShape]:
    """The full product of the supported inputs: one shape per distinct tile, split count and flag."""
    return [
        LaunchShape(dtype, dim, hpk, size, query_len, splits, softcap, window)
        for dtype, dim, hpk, size in itertools.product(DTYPES, HEAD_DIMS, HEADS_PER_KV, BLOCK_SIZES)
        for query_len in tile_shapes(hpk).values()
        for splits, softcap, window in itertools.product(split_counts(), *[(False, True)] * 2)
    ]


def pairwise(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Rows of value indices in which every pair of values of every two axes occurs at least once (a greedy,
    deterministic covering array: each row starts from the first uncovered pair and fills the other axes with the
    values that cover the most uncovered pairs).

    Args:
        sizes: the number of values of each axis.
    """
    axes = range(len(sizes))
    uncovered = {
        (i, a, j, b) for i, j in itertools.combinations(axes, 2) for a in range(sizes[i]) for b in range(sizes[j])
    }
    rows = []
    while uncovered:
        i, a, j, b = min(uncovered)
        row: dict[int, int] = {i: a, j: b}
        for k in axes:
            if k not in row:
                gain = [
                    sum(((m, row[m], k, v) if m < k else (k, v, m, row[m])) in uncovered for m in row)
                    for v in range(sizes[k])
                ]
                row[k] = gain.index(max(gain))
        rows.append(tuple(row[k] for k in axes))
        uncovered -= {(m, row[m], k, row[k]) for m, k in itertools.combinations(axes, 2)}
    return rows


def covering_launch_shapes() -> list[LaunchShape]:
    """Every pair of input values at least once (`pairwise` over dtype, head dim, heads per KV head, block size,
    tile, split count and both flags; the one-block loop is the tiling's at 64-token blocks), plus each dtype's
    largest-resource shape (the most shared memory: the largest head dim, block size and tile): a fast stand-in for
    `all_launch_shapes`."""
    splits = split_counts()
    tiles = [sorted(tile_shapes(hpk).values()) for hpk in HEADS_PER_KV]
    axes: list[Sequence[Any]] = [DTYPES, HEAD_DIMS, range(len(HEADS_PER_KV)), BLOCK_SIZES, range(max(map(len, tiles)))]
    axes += [splits, (False, True), (False, True)]
    shapes = []
    for row in pairwise([len(axis) for axis in axes]):
        dtype, dim, hpk, size, tile, split, softcap, window = (axis[index] for axis, index in zip(axes, row))
        query_len = tiles[hpk][min(tile, len(tiles[hpk]) - 1)]
        shapes.append(LaunchShape(dtype, dim, HEADS_PER_KV[hpk], size, query_len, split, softcap, window))
    return shapes + largest_launch_shapes()


def largest_launch_shapes() -> list[LaunchShape]:
    """Each dtype's largest-resource shape: the most shared memory (the largest head dim, block size and tile), split
    so that it launches the merge kernel with the most splits too."""
    tile = max(tile_shapes(1).values())
    return [
        LaunchShape(dtype, max(HEAD_DIMS), 1, max(BLOCK_SIZES), tile, split_counts()[-1], True, True)
        for dtype in DTYPES
    ]


@dataclass(frozen=True)
class Launch:
    """One kernel launch's arguments, as `paged_attention` passes them."""

    kernel: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(hash=False)


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, name: str, sink: list[Launch]):
        self.name, self.sink = name, sink

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: self.sink.append(Launch(self.name, args, kwargs))


@contextlib.contextmanager
def _recording(sink: list[Launch]) -> Iterator[None]:
    """Swap the module's kernels for recorders (paged_attention looks them up as module globals at each call)."""
    saved = {name: getattr(triton_attention, name) for name in KERNELS}
    try:
        for name in KERNELS:
            setattr(triton_attention, name, _Recorder(name, sink))
        yield
    finally:
        for name, kernel in saved.items():
            setattr(triton_attention, name, kernel)


def record_launches(shape: LaunchShape) -> list[Launch]:
    """The launches `paged_attention` makes for `shape` (one sequence of `query_len` new tokens, one KV head, on
    small CPU tensors), recorded rather than run. Under TRITON_INTERPRET=1 they are the interpreter's (UPCAST set
    for 16-bit dtypes), not a GPU's.

    Args:
        shape: the inputs to launch with.
    """
    blocks = -(-shape.query_len // shape.block_size)
    query = torch.zeros(shape.query_len, shape.heads_per_kv, shape.head_dim, dtype=shape.dtype)
    cache = torch.zeros(blocks, shape.block_size, 1, shape.head_dim, dtype=shape.dtype)
    table = torch.arange(blocks).view(1, blocks)
    cpu = torch.device("cpu")
    tiling = Tiling.for_device(cpu)
    attention_plan = plan(
        [shape.query_len], [0], table, shape.heads_per_kv, 1, shape.block_size, cpu, shape.num_splits, tiling
    )
    window, softcap = WINDOW if shape.window else None, 30.0 if shape.softcap else None
    launches: list[Launch] = []
    with _recording(launches):
        paged_attention(query, cache, cache, attention_plan, 0.125, window, softcap)
    return launches


@dataclass(frozen=True)
class KernelVariant:
    """One compiled binary of a kernel: Triton's JIT cache key, and what `triton.compile` takes to build it."""

    kernel: str
    key: str  # compute_cache_key of the launch's specialization: equal keys share one compiled binary
    signature: dict[str, str] = field(compare=False, hash=False)
    constexprs: dict[str, Any] = field(compare=False, hash=False)
    attrs: dict[tuple[int, ...], Any] = field(compare=False, hash=False)
    options: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # num_warps / num_stages passed

    @property
    def label(self) -> str:
        """The variant for people: kernel, the output's type and the constexprs."""
        constants = " ".join(f"{name}={value}" for name, value in self.constexprs.items())
        return f"{self.kernel} {self.signature['out_ptr'][1:]} {constants}"


# Keyed by id() (a JITFunction hashes by its source's dependencies), holding the object too: ids are not reused.
_BINDERS: dict[int, tuple[JITFunction, Any, Any]] = {}


def as_jit_function(kernel: Any) -> JITFunction:
    """`kernel` as a JITFunction, whose parameters (do_not_specialize included) Triton's binder reads: itself, or,
    under TRITON_INTERPRET=1, one built from the interpreted function's source with the same options.

    Args:
        kernel: a `@triton.jit` function, compiled or interpreted.
    """
    return kernel if isinstance(kernel, JITFunction) else _rebuilt(kernel)


@functools.cache  # once per interpreted kernel: binders are cached per JITFunction
def _rebuilt(kernel: Any) -> JITFunction:
    options = {k: kernel.kwargs.get(k) for k in ("do_not_specialize", "do_not_specialize_on_alignment")}
    return JITFunction(kernel.fn, **options)


def specialize(launch: Launch, kernel: JITFunction | None = None) -> KernelVariant:
    """The variant a launch asks for: Triton's binder gives the argument specialization, `compute_cache_key` the
    key its JIT cache stores the binary under (as `JITFunction.run` does; the CUDA backend specializes alike on
    every architecture).

    Args:
        launch: a recorded launch of one of `KERNELS`.
        kernel: the JITFunction whose parameters bind the launch (default: the module's kernel of that name; pass
            another to see what different `do_not_specialize` options would ask for).
    """
    jit = kernel or as_jit_function(getattr(triton_attention, launch.kernel))
    if id(jit) not in _BINDERS:
        backend = make_backend(TARGETS["sm_90"][0])
        _BINDERS[id(jit)] = (jit, backend, create_function_from_signature(jit.signature, jit.params, backend))
    jit, backend, binder = _BINDERS[id(jit)]
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    key = compute_cache_key({}, specialization, options)
    _, signature, constexprs, attrs = jit._pack_args(backend, dict(launch.kwargs), bound, specialization, options)
    names = {path: jit.arg_names[path[0]] for path in constexprs}
    passed = {name: launch.kwargs[name] for name in LAUNCH_OPTIONS if name in launch.kwargs}
    return KernelVariant(launch.kernel, key, signature, {names[p]: v for p, v in constexprs.items()}, attrs, passed)


def kernel_variants(shapes: Sequence[LaunchShape]) -> list[KernelVariant]:
    """The distinct variants (each once, in first-launch order) that launching every shape asks for.

    Args:
        shapes: the launch inputs, e.g. `covering_launch_shapes()`.
    """
    return list(dict.fromkeys(specialize(launch) for shape in shapes for launch in record_launches(shape)))
