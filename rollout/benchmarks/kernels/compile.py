"""Compiling the Triton kernel variants the engine can launch (`kernel_variants.py`) for NVIDIA Hopper (sm_90) and
Ampere (sm_80) without a GPU: `triton.compile(ASTSource(...), target=GPUTarget(...))` needs only the ptxas inside
the triton wheel. A compile error, or shared memory above the target's limit, is a result to report.

Compiling needs the kernels as JITFunctions: run it with TRITON_INTERPRET unset (`python -m
rollout.benchmarks.kernels.compile`, as tests/test_kernel_compile.py does in a subprocess).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context

import triton
from triton import knobs
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from rollout.benchmarks.kernels.variants import (
    TARGETS,
    KernelVariant,
    all_launch_shapes,
    covering_launch_shapes,
    kernel_variants,
    largest_launch_shapes,
)
from rollout.engine.attention import triton_kernel as triton_attention
from rollout.process_groups import die_with_parent


@dataclass
class CompileResult:
    """One variant compiled for one target."""

    label: str
    target: str
    shared: int | None  # bytes of shared memory per block (None when compiling failed)
    shared_limit: int
    seconds: float
    error: str | None = None

    @property
    def fits(self) -> bool:
        """Compiled, within the target's shared memory."""
        return self.error is None and self.shared is not None and self.shared <= self.shared_limit


def compile_variant(variant: KernelVariant, target: str) -> CompileResult:
    """Compile `variant` for `target` (a key of `TARGETS`) down to a cubin with the wheel's ptxas; a failure is
    returned as the result's error, not raised.

    Args:
        variant: from `kernel_variants`.
        target: "sm_90" or "sm_80".
    """
    kernel = getattr(triton_attention, variant.kernel)
    if not isinstance(kernel, JITFunction):
        raise RuntimeError("compiling needs the kernels as JITFunctions: unset TRITON_INTERPRET")
    gpu, limit = TARGETS[target]
    start = time.perf_counter()
    try:
        source = ASTSource(kernel, variant.signature, variant.constexprs, variant.attrs)
        compiled = triton.compile(source, target=gpu, options=variant.options)
        shared, error = int(compiled.metadata.shared), None
    except Exception as failure:  # noqa: BLE001 - every compile failure is a result to report
        shared, error = None, f"{type(failure).__name__}: {failure}"
    return CompileResult(variant.label, target, shared, limit, time.perf_counter() - start, error)


def compile_all(variants: Sequence[KernelVariant], targets: Sequence[str], workers: int = 1) -> list[CompileResult]:
    """Compile every variant for every target (see `compile_jobs`).

    Args:
        variants: from `kernel_variants`.
        targets: keys of `TARGETS`.
        workers: processes to compile on.
    """
    return compile_jobs([(v, t) for v in variants for t in targets], workers)


def compile_jobs(jobs: Sequence[tuple[KernelVariant, str]], workers: int = 1) -> list[CompileResult]:
    """Compile (variant, target) pairs on `workers` processes (spawned: each compiles independently; a script calling
    this with workers > 1 needs the `if __name__ == "__main__":` guard that spawning requires).

    Args:
        jobs: (variant from `kernel_variants`, key of `TARGETS`) pairs.
        workers: processes to compile on.
    """

    def cost(job: tuple[KernelVariant, str]) -> int:  # fp32 and big tiles compile slowest: start them first
        c = job[0].constexprs
        return (4 if "fp32" in job[0].signature["out_ptr"] else 2) * c["BLOCK_M"] * c.get("BLOCK_N", 1) * c["BLOCK_D"]

    jobs = sorted(jobs, key=cost, reverse=True)
    if workers <= 1:
        return [compile_variant(*job) for job in jobs]
    # Each worker dies with this process, even one killed outright (its workers would otherwise compile on).
    initializer = functools.partial(die_with_parent, os.getpid())
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=initializer) as pool:
        return list(pool.map(compile_variant, *zip(*jobs)))


def main(argv: Sequence[str] | None = None) -> None:
    """Compile the launchable variants for the targets; print a summary, optionally write every result as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--matrix",
        choices=("suite", "covering", "full"),
        default="covering",
        help="suite: the covering variants for sm_90 and the largest-resource ones for every target (what the CPU "
        "test suite compiles); covering: the covering variants for every target; full: every variant",
    )
    parser.add_argument("--targets", nargs="+", choices=sorted(TARGETS), default=sorted(TARGETS, reverse=True))
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--json", help="write {variants, seconds, results} here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    shapes = all_launch_shapes() if args.matrix == "full" else covering_launch_shapes()
    variants = kernel_variants(shapes)
    if args.matrix == "suite":  # every variant on Hopper; Ampere's smaller shared memory at the largest shapes
        largest = kernel_variants(largest_launch_shapes())
        jobs = [(v, "sm_90") for v in variants] + [(v, t) for v in largest for t in args.targets if t != "sm_90"]
        results = compile_jobs(jobs, args.workers)
    else:
        results = compile_all(variants, args.targets, args.workers)
    seconds = time.perf_counter() - start
    for r in results:
        if not r.fits:
            print(f"{r.target} {r.label}: shared {r.shared}/{r.shared_limit} {r.error or ''}")
    print(f"{len(shapes)} shapes, {len(variants)} variants, {len(results)} compiles in {seconds:.1f} s")
    print(f"ptxas: {knobs.nvidia.ptxas.path}")
    if args.json:
        with open(args.json, "w") as out:
            summary = {"matrix": args.matrix, "variants": len(variants), "seconds": seconds}
            json.dump({**summary, "results": [asdict(r) for r in results]}, out)


if __name__ == "__main__":
    main()
