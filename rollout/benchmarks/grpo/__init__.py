"""GRPO workloads:

- `grpo.py`: `rollout-bench grpo`, rollouts of a GRPO batch;
- `grpo_step.py`: `rollout-bench grpo-step`, whole steps (generation, rewards, loss, optimizer step), each system in
  a process of its own running `step_system.py`; `grpo_long_tail.py`: its `--partial-rollouts` shape; `routing_replay.py`: its `--routing-replay` (MoE);
- `long_tail.py`: `rollout-bench long-tail`, reasoning lengths with a small KV cache (`long_tail_flags.py`: its
  flags; `long_tail_workload.py`: its samples and their lengths; `long_tail_probe.py`: what it reads of the engine;
  `long_tail_speculative.py`: without and with speculative decoding, side by side; `long_tail_table.py`: its table).
"""
