"""`rollout-bench gpu-report --plan`: the device calls that produce the whole GPU report when GPU time comes in calls
of at most 10 minutes, each on a machine started fresh (nothing installed, nothing kept from the call before).

Each call runs some of gpu-report's sections under a budget of seconds (`--budget-s`: a section gets at most what is
left, and the report is written after every section, so a call cut short keeps what finished). The first call alone
gives the headline (nano throughput of rollout, rollout_sequential and transformers' generate_batch, the decode
roofline fraction, bf16 logprob fidelity against the trainer's floor, the kernel tests, a colocated GRPO step on the
Qwen3-0.6B architecture); each later call takes the earlier calls' gpu_report.json in (`--merge`) and extends the
same report.
"""

from __future__ import annotations

from dataclasses import dataclass

# Wheels a GPU image with torch, transformers, Triton and accelerate lacks (trainer_bridge's TRL integration, the
# worker's sockets), downloaded where pip reaches PyPI, for the image's Python 3.12 on x86-64.
WHEELS = (
    "pyzmq==27.3.0",
    "trl==1.16.0",
    "datasets==4.8.4",
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "xgrammar==0.2.8",  # structured outputs (the section "structured")
    "apache-tvm-ffi==0.1.15.post2",  # xgrammar's
)
WHEEL_DIR = ".whl"
EARLIER_DIR = ".gpu-report"  # where the earlier calls' gpu_report.json is put before a later call (carried)
MINUTES_PER_CALL = 9  # of the 10 a call may take: installing the wheels and starting Python fit in the rest


@dataclass(frozen=True)
class DeviceCall:
    """One call of the device: which sections, and the seconds they may take together."""

    title: str
    sections: tuple[str, ...]
    budget_s: int


CALLS = (
    DeviceCall("the headline", ("kernel-tests", "throughput", "grpo-step-nano"), 500),
    DeviceCall(
        "GPU tests, structured outputs, GRPO groups and weight pushes",
        ("gpu-tests", "structured", "grpo", "weights"),
        500,
    ),
    DeviceCall(
        "whole GRPO steps of the main job; current vs previous GPU paths", ("grpo-step", "throughput-previous"), 500
    ),
)


def download_command() -> str:
    """The pip command (run here, where PyPI is reachable) that fetches the wheels every call carries."""
    platforms = " ".join(
        f"--platform {tag}"
        for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
    )
    return (
        f"python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp {platforms} "
        f"-d {WHEEL_DIR} {' '.join(WHEELS)}"
    )


def call_command(call: DeviceCall, first: bool) -> str:
    """The shell command of one call, run from the checkout's root on the device ($OUT: what comes back)."""
    install = (
        f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
        f"{WHEEL_DIR}/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1"
    )
    merge = "" if first else f" --merge {EARLIER_DIR}/gpu_report.json"
    report = (
        f"python3 -m rollout.benchmarks.cli gpu-report --only {' '.join(call.sections)} --budget-s {call.budget_s} "
        f"--out $OUT/gpu-report{merge}"
    )
    return f"{install}; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; {report}"


def render_plan() -> str:
    """The plan as text: the one-time download, then each call's carry list, command and what to do with its files."""
    lines = [
        f"rollout GPU report in {len(CALLS)} device calls of at most {MINUTES_PER_CALL} minutes each, every call on "
        "a fresh machine (H100 or H200, the image's torch, transformers and Triton).",
        "",
        "Once, here (PyPI reachable), in the checkout's root: ignore and fetch the wheels the GPU image lacks",
        f"  echo /{WHEEL_DIR}/ >> .git/info/exclude; echo /{EARLIER_DIR}/ >> .git/info/exclude",
        f"  {download_command()}",
    ]
    for number, call in enumerate(CALLS, 1):
        first = number == 1
        carry = [WHEEL_DIR] if first else [WHEEL_DIR, EARLIER_DIR]
        lines += [
            "",
            f"Call {number}: {call.title} ({', '.join(call.sections)}; at most {call.budget_s} s of sections)",
        ]
        if not first:
            lines.append(
                f"  before: copy call {number - 1}'s gpu-report/gpu_report.json (from what came back) to "
                f"{EARLIER_DIR}/gpu_report.json"
            )
        lines += [
            f"  carry: {carry}",
            f"  timeout_s: {MINUTES_PER_CALL * 60 + 60}",
            f"  command: {call_command(call, first)}",
            "  after: gpu-report/gpu_report.md is the report so far; gpu_report.json feeds the next call",
        ]
    return "\n".join(lines)
