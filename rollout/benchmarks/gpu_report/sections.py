"""The sections of `rollout-bench gpu-report`, in the order they run, the headline first: each a `rollout-bench` or
pytest command with its ceiling, its least time under a budget (`reserve_s`) and, for a benchmark, the flag that
tells it its time. `--workload cpu-small` gives the same commands on the CPU shapes (the plan's rehearsal)."""

from __future__ import annotations

import sys
from pathlib import Path

from rollout.benchmarks.harness.section_run import Section

# The kernel-tests section's files: the Triton kernels, the decode graphs and the verify graphs of drafted steps.
KERNEL_TESTS = ("test_triton_attention.py", "test_cuda_graphs.py", "test_verify_graphs.py")


def sections(tests_dir: Path, python: str = sys.executable, workload: str = "nano") -> list[Section]:
    """The report's sections, in the order they run: the headline first (`plan.FIRST_CALL`). Timeouts are
    ceilings well above what each should take on an H200, so a hang is reported rather than waited out; `--only`
    splits a run across calls (`--plan` prints them) and `--budget-s` caps a whole call, where each section's
    `reserve_s` is the least it is started with (the sections before it leave it that much).

    Args:
        tests_dir: the checkout's tests folder (the test sections).
        python: the interpreter every section runs with.
        workload: "nano" on a GPU; "cpu-small" rehearses the same sections on a CPU (`plan.rehearsal_commands`).
    """
    bench = (python, "-m", "rollout.benchmarks.cli")
    pytest = (python, "-m", "pytest", "-q", "-p", "no:cacheprovider")
    rehearsal = workload != "nano"
    device = "cpu" if rehearsal else "cuda"
    throughput = (*bench, "throughput", "--workload", workload, "--repeats", "1", "--systems")
    colocated = ("--model", "tiny", "--steps", "1") if rehearsal else ("--model", "nano", "--steps", "3")
    # The long tail on a GPU: the Qwen3-0.6B architecture, whose forward is a real share of a step there (the tiny
    # model's costs the GPU next to nothing: its steps measure the host alone, which a CPU run already shows).
    speculative_model = "tiny" if rehearsal else "nano"

    def measure(name: str, title: str, systems: tuple[str, ...], ceiling: float, reserve_s: float) -> Section:
        """A `rollout-bench throughput` section: `systems` and its flags (told its time: a baseline stops in it)."""
        argv = (*throughput, *systems)
        return Section(
            name, title, argv, ceiling, benchmark="throughput", budget_flag="--time-budget", reserve_s=reserve_s
        )

    return [
        measure(
            "throughput",
            f"{workload} workload: rollout, its batch_invariant price, decode roofline, bf16 logprob fidelity",
            ("rollout", "--batch-invariant", "--details"),  # rollout_invariant right after rollout: the price
            300,
            120,
        ),
        measure(
            "baseline-generate-batch",
            f"{workload} workload: transformers' generate_batch",
            ("transformers_generate_batch",),
            80,  # about 10x slower than rollout on an H200: it is cut short, and its rate is what it finished
            60,
        ),
        measure(
            "baseline-generate",
            f"{workload} workload: transformers' generate (one static batch)",
            ("transformers_generate",),
            90,
            40,
        ),
        Section(
            "grpo-step-nano",
            "a colocated GRPO step, Qwen3-0.6B architecture, then the same with batch_invariant=True"
            + (" (tiny model: rehearsal)" if rehearsal else ""),
            # The invariant step second: a section cut at its limit keeps the plain step's figures.
            (*bench, "grpo-step", "--device", device, "--systems", "rollout_colocate", "rollout_colocate_invariant")
            + colocated,
            240,
            benchmark="grpo-step",
            reserve_s=60,
        ),
        Section(
            "weights",
            "weights into a GPU worker",
            (*bench, "weights", "--device", device, "--dtype", "bfloat16", "--size-mb", "1200")
            + ("--transports", "frames", "shm", "--repeats", "3"),
            150,
            benchmark="weights",
            reserve_s=60,
        ),
        Section(
            "gpu-tests",
            "GPU tests (tests/gpu)",
            (*pytest, "-m", "gpu", str(tests_dir / "gpu")),
            150,
            tests=True,
            reserve_s=60,
            skips_expected="a CPU rehearsal: every GPU test needs a CUDA device" if rehearsal else None,
        ),
        Section(
            "speculative",
            f"speculative decoding in the long tail: the {speculative_model} model at low entropy (0.1 nats), without "
            "and with drafts",
            (*bench, "long-tail", "--model", speculative_model, "--device", device, "--speculative", "suffix")
            + (
                "--entropy",
                "0.1",
                "--known-lengths",
                "--cache-fraction",
                "2",
                "--repeats",
                "3",
                "--max-num-seqs",
                "64",
            ),
            150,
            benchmark="long-tail",
            budget_flag="--time-budget",  # its pairs of runs stop inside its share: the kernel tests keep theirs
            reserve_s=45,
        ),
        Section(
            "kernel-tests",
            "Triton kernels and CUDA graphs, compiled",
            (*pytest, *(str(tests_dir / name) for name in KERNEL_TESTS)),
            150,  # test_compiled_decode_matches_generate traces with dynamo: over 30 s on an H200
            tests=True,
            reserve_s=80,  # the first H200 run got through 67 of 70 in 76 s
        ),
        Section("grpo", "GRPO workload", (*bench, "grpo", "--device", device), 200, benchmark="grpo", reserve_s=60),
        Section(
            "grpo-step",
            "GRPO steps: rollout colocated and server vs TRL's generate and generate_batch",
            (*bench, "grpo-step", "--device", device),
            300,
            benchmark="grpo-step",
            reserve_s=60,
        ),
        measure(
            "overlap", f"{workload} workload: rollout with overlapped scheduling off", ("rollout_sequential",), 150, 60
        ),
        Section(
            "structured",
            "structured outputs: host time at 64/256 constrained rows, compile, nano throughput constrained vs not",
            (*bench, "structured", "--device", device),
            240,
            benchmark="structured",
            reserve_s=60,
        ),
    ]


SECTION_NAMES = tuple(section.name for section in sections(Path("tests")))
