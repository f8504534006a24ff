"""`rollout-bench gpu-report --plan`: the device calls that produce the GPU report when GPU time comes in one window of
15 minutes in all (each machine start about 90 s of it), at most 10 minutes and 2,000 characters per command, on a
machine that starts bare (nothing installed, nothing kept from a call before).

The first call alone gives the headline, printed and written as each section finishes, in this order: rollout's nano
throughput (tokens/s, `batch_invariant`'s price beside it, the decode roofline fraction, bf16 logprob fidelity against
the trainer's floor); transformers' `generate_batch` on the same workload under a budget of its own, then its `generate`
with what is left (a baseline cut short says so, with what it finished); a colocated GRPO step at nano shape. The
optional follow-up merges the first call's gpu_report.json and measures what the CPU cannot: the GPU tests (graph
capture and replay, bitwise log-probs), speculative decoding's long tail on the GPU (the Qwen3-0.6B architecture),
and the kernel tests (compiled; the first H200 run, 2026-11-30, needed more than the 76 s the first call had left
them). Both together, machine starts included, fit `DEVICE_BUDGET_S`. Weight pushes into a GPU worker (`weights`, measured on that first run) are left to
`--only`.

The GPU image has Python 3.12, torch 2.11, transformers 5.17 and Triton 3.6, and lacks the wheels in `WHEELS`. The
rehearsal (`rehearsal_commands`) runs each call's command on the cpu-small workload in a Python 3.12 virtualenv with
the image's versions, on a CPU, before any GPU second is spent.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

DEVICE_BUDGET_S = 900  # the whole window: every call and every machine start
START_S = 90  # one machine start (a fresh machine for each call: the first one is given back, or idles out)
COMMAND_CHARS = 2000  # the device tool's limit on one command
SETUP_S = 35  # of a call's timeout: installing the wheels, nvidia-smi, Python's start and the last report's write

# Wheels the GPU image lacks (the worker's sockets, TRL and its datasets, xgrammar and its pydantic), for its Python
# 3.12 on x86-64. pydantic 2.12 (not newer): it needs typing-extensions>=4.14.1, which torch's image already has.
WHEELS = (
    "pyzmq==27.3.0",
    "trl==1.16.0",
    "datasets==4.8.4",
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "xgrammar==0.2.8",
    "apache-tvm-ffi==0.1.15.post2",  # xgrammar's
    "pydantic==2.12.5",  # xgrammar's, with the three below
    "pydantic-core==2.41.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
)
WHEEL_DIR = ".whl"
EARLIER_DIR = ".gpu-report"  # where the first call's gpu_report.json is put before the follow-up (carried)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# What the GPU image holds (its pip list), installed in the rehearsal's virtualenv; PyPI's torch wheel runs on a CPU.
IMAGE_PACKAGES = (
    "torch==2.11.0",
    "transformers==5.17.0",
    "triton==3.6.0",
    "numpy==2.5.2",
    "accelerate==1.15.0",
    "safetensors==0.8.0",
    "huggingface_hub==1.33.0",
    "peft",
    "msgpack",
    "xxhash",
    "prometheus-client",
    "tqdm",
    "pytest",
    "pytest-timeout",
    "hypothesis",
    "pandas",
    "pyarrow",
    "fsspec<=2026.2.0",
    "psutil",
    "pyyaml",
    "requests",
    "httpx",
    "jinja2",
)
REHEARSAL_VENV = "/tmp/rollout-gpu-rehearsal"


@dataclass(frozen=True)
class DeviceCall:
    """One call of the device: its sections, in the order they run, and the seconds the call may take."""

    title: str
    sections: tuple[str, ...]
    timeout_s: int  # the device call's timeout_s
    optional: bool = False

    @property
    def budget_s(self) -> int:
        """Seconds the sections share (`gpu-report --budget-s`): the call's timeout less the set-up around them."""
        return self.timeout_s - SETUP_S


FIRST_CALL = DeviceCall(
    "the headline",
    ("throughput", "baseline-generate-batch", "baseline-generate", "grpo-step-nano"),
    430,
)
SLACK_S = 30  # of the window, for what else counts: transfers, the idle wait before a machine goes back
FOLLOW_UP = DeviceCall(
    "the GPU tests (graph capture and replay, bitwise log-probs), speculative decoding and the kernel tests",
    ("gpu-tests", "speculative", "kernel-tests"),
    DEVICE_BUDGET_S - 2 * START_S - FIRST_CALL.timeout_s - SLACK_S,
    optional=True,
)
CALLS = (FIRST_CALL, FOLLOW_UP)


def download_command() -> str:
    """The pip command (run here, where PyPI is reachable) that fetches the wheels every call carries."""
    platforms = " ".join(f"--platform {tag}" for tag in PLATFORMS)
    return (
        f"python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp {platforms} "
        f"-d {WHEEL_DIR} {' '.join(WHEELS)}"
    )


def install_command(python: str = "python3") -> str:
    """Install the carried wheels beside the image's packages, and put them and the checkout on the path."""
    return (
        f"{python} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
        f"{WHEEL_DIR}/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1"
    )


def report_command(call: DeviceCall, first: bool, python: str = "python3", workload: str | None = None) -> str:
    """The gpu-report command line of one call (`workload`: the rehearsal's cpu-small instead of the GPU's nano).
    It names the checkout's commit: the copy on the device has no git history to read it from."""
    merge = "" if first else f" --merge {EARLIER_DIR}/gpu_report.json"
    rehearse = f" --workload {workload}" if workload else ""
    commit = checkout_commit()
    named = f" --commit {commit}" if commit else ""
    return (
        f"{python} -m rollout.benchmarks.cli gpu-report --only {' '.join(call.sections)} --budget-s {call.budget_s} "
        f"--out $OUT/gpu-report{merge}{named}{rehearse}"
    )


def checkout_commit() -> str | None:
    """This checkout's commit, short, with "-dirty" when files differ from it; None outside a git checkout."""
    try:
        found = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = found.stdout.strip()
    return commit if found.returncode == 0 and re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", commit) else None


def call_command(call: DeviceCall, first: bool) -> str:
    """The shell command of one call, run from the checkout's root on the device ($OUT: what comes back)."""
    gpu = "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv"
    return f"{install_command()}; {gpu}; {report_command(call, first)}"


def rehearsal_commands() -> list[str]:
    """The rehearsal, run here on a CPU from the checkout's root: a Python 3.12 virtualenv with the GPU image's
    versions, the carried wheels installed as on the device, and each call's command on the cpu-small workload, the
    first call's report merged into the next as on the device (everything but the GPU: the same code paths, imports
    and flags; sections that need a GPU say so)."""
    python = f"{REHEARSAL_VENV}/bin/python3"
    reports = [report_command(FIRST_CALL, True, python, "cpu-small")]
    for call in CALLS[1:]:
        copy = f"mkdir -p {EARLIER_DIR} && cp $OUT/gpu-report/gpu_report.json {EARLIER_DIR}/"
        reports.append(f"{copy} && {report_command(call, False, python, 'cpu-small')}")
    return [
        f"python3.12 -m venv {REHEARSAL_VENV}",
        f"{python} -m pip install -q {' '.join(repr(p) if '<' in p else p for p in IMAGE_PACKAGES)}",
        # In a subshell: its exports and `exit` stay there, whatever shell it is pasted into.
        f"(export OUT=$(mktemp -d); {install_command(python)}; {'; '.join(reports)})",
    ]


def after_line(last: bool) -> str:
    """What a call's files (`files_at`) hold: the report so far, whose JSON the next call merges; after the last
    call, the whole report. A test section's <section>.outcomes.jsonl has its tests' outcomes as they finished."""
    if last:
        return (
            "gpu-report/gpu_report.md is the whole report (the first call's sections merged in), gpu_report.json the "
            "same as JSON; <section>.outcomes.jsonl: each test's outcome as it finished (a run cut short included)"
        )
    return "gpu-report/gpu_report.md is the report so far; its gpu_report.json is what the next call's `before` copies"


def plan() -> dict:
    """The plan as one JSON-able object: the window, the preparation here, the rehearsal, and each call."""
    calls = []
    for number, call in enumerate(CALLS, 1):
        first = number == 1
        calls.append(
            {
                "title": call.title,
                "optional": call.optional,
                "timeout_s": call.timeout_s,
                "budget_s": call.budget_s,
                "sections": list(call.sections),
                "carry": [WHEEL_DIR] if first else [WHEEL_DIR, EARLIER_DIR],
                "before": None
                if first
                else f"mkdir -p {EARLIER_DIR} && cp FILES_AT/gpu-report/gpu_report.json {EARLIER_DIR}/ (FILES_AT: where "
                "the first call's files came back)",
                "command": call_command(call, first),
                "after": after_line(number == len(CALLS)),
            }
        )
    return {
        "device_budget_s": DEVICE_BUDGET_S,
        "start_s": START_S,
        "total_s": sum(call["timeout_s"] + START_S for call in calls),
        "prepare": [
            f"echo /{WHEEL_DIR}/ >> .git/info/exclude; echo /{EARLIER_DIR}/ >> .git/info/exclude",
            download_command(),
        ],
        "rehearsal": rehearsal_commands(),
        "calls": calls,
    }


def render_plan(as_json: bool = False) -> str:
    """The plan as text (or, `as_json`, as one JSON object): the one-time preparation, the rehearsal, each call."""
    found = plan()
    if as_json:
        return json.dumps(found, indent=2)
    lines = [
        f"rollout GPU report: {len(CALLS)} device calls, {found['total_s']} s of the {DEVICE_BUDGET_S} s window with "
        f"a {START_S} s machine start each (the second is optional; give the machine back after each).",
        "",
        "Once, here (PyPI reachable), in the checkout's root: ignore and fetch the wheels the GPU image lacks",
        *(f"  {line}" for line in found["prepare"]),
        "",
        "Rehearse here, on a CPU, before spending GPU time (the image's Python and versions; cpu-small workload):",
        *(f"  {line}" for line in found["rehearsal"]),
    ]
    for number, call in enumerate(found["calls"], 1):
        lines += ["", f"Call {number}{' (optional)' if call['optional'] else ''}: {call['title']}"]
        lines.append(f"  sections, in order: {', '.join(call['sections'])} (at most {call['budget_s']} s together)")
        if call["before"]:
            lines.append(f"  before: {call['before']}")
        lines += [
            f"  carry: {call['carry']}",
            f"  timeout_s: {call['timeout_s']}",
            f"  command: {call['command']}",
            f"  after: {call['after']}",
        ]
    return "\n".join(lines)
