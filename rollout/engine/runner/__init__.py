"""The model runner: a `ScheduledBatch` as tensors through the model, out as the logits of the sampled positions.

- `model_checks.py`: which models a runner accepts, and how it runs attention;
- `model_context.py`: the longest sequence a model's positions serve (its context, RoPE-scaled);
- `attention_probe.py`: one two-token forward at build showing what each attention layer hands its function;
- `attention_call_checks.py`: what those calls must show for the paged cache to serve the model;
- `model_lease.py`: the model lent to the engines that use it (paged attention, eval mode) and given back;
- `training_mode.py`: a model's training flags and kernels mode as found, put back by the probe and the lease;
- `model_runner.py`: one step's tensors, the forward and its logits;
- `step_inputs.py`: the step's packed input ids and the rows whose logits it keeps;
- `step_graphs.py`: which CUDA graphs the runner keeps, and which one replays a step that fits it;
- `verify_layout.py`: a drafted step laid out a fixed number of rows per sequence, for the verify graphs;
- `model_forward.py`: the model call itself (packed ids, positions, paged metadata -> the kept rows' logits);
- `cuda_graphs.py`: decode steps (and drafted steps) captured once per bucketed batch size and replayed.
"""
