"""`rollout-bench throughput`: generated tokens/s of this engine against other systems, in the order a run goes:

- `throughput.py`: the subcommand (workload, systems, the table and its JSON line);
- `systems.py`: each system measured in a process of its own (`device_profile.py`: rollout's, on a GPU, profiled);
- `details.py`: `--details`, from instrumented runs (decode roofline, step phases);
- `host_time.py`: the engine's host time per decode step;
- `fidelity.py`: logprob fidelity against the trainer, on a model with realistic entropy.
"""
