"""The names and numbers `rollout-bench`'s parser offers, defined here once and free of torch, so that the parser
builds (and `--help` answers) without loading what the benchmarks run: each module that runs them imports its own
from here. (The workloads' names are `workloads.WORKLOADS`'s keys, a module free of torch too.)"""

from __future__ import annotations

# `throughput --systems`: the systems `systems.py` runs, each by its function `run_<name>`.
SYSTEM_NAMES = (
    "rollout",
    "rollout_sequential",
    "rollout_json",
    "rollout_lora1",
    "rollout_lora4",
    "rollout_invariant",
    "transformers_generate_batch",
    "transformers_generate",
)
# `service --path`: ZeroMQ, the HTTP API beside ZeroMQ, or both (service.py).
SERVICE_PATHS = ("zmq", "http", "all")
# `grpo --num-prompts`: groups per run (grpo.py).
GRPO_NUM_PROMPTS = 32
