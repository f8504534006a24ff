"""`rollout-bench`: benchmark workloads, each printing a table and, last, one line of JSON.

- `cli.py`: the subcommands and their flags (free of torch); `commands.py` runs the parsed one; `plots.py`: `--plot`;
- `harness/`: what every benchmark runs on (workloads, a system in a process of its own, a worker subprocess,
  progress lines, the parser's names);
- `throughput/`: tokens/s against transformers and vLLM, host time per step, logprob fidelity;
- `grpo/`: whole GRPO steps, the long tail, MoE routing replay;
- `service/`: the socket's cost, weight pushes, agents on a fleet, Ray fleets;
- `structured/`: what structured outputs cost;
- `load/`, `fuzz/`: many trainers against a worker, and malformed messages fired at one;
- `kernels/`: the Triton kernel's variants, compiled for sm_90 / sm_80 without a GPU;
- `gpu_report/`: every GPU figure in one run (`rollout-bench gpu-report`, `--plan`).
"""
