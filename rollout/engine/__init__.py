"""The continuous-batching engine, in process. One request crosses these folders in this order:

- `requests/`: a prompt and its settings checked and resolved into a group's leader `Request` (`intake.py`,
  `request.py`), and what each sample produced (`outputs.py`, `GenerationOutput`);
- `manager/`: `ContinuousBatchingManager`, the caller side, and its engine thread, fed through a mailbox of typed
  commands (pause, results, weight updates on their way in);
- `engine.py`: `Engine.step()`, schedule -> run -> sample -> update (`step_loop.py`; `step_failures.py`: what a
  failed step does to its samples); `warmup.py` and `counters.py` act on a whole
  engine from outside its loop; `generate.py`: `generate_batch`, the one-call API over a cached engine (kept on the
  model between calls: `kept_engines.py`; its bar of samples and tokens: `progress.py`);
- `scheduling/`: which requests compute how many tokens (a `ScheduledBatch`) and their KV blocks (no torch);
- `runner/`: a `ScheduledBatch` as tensors through the model, over the paged cache (`kv/`) and paged attention
  (`attention/`), with LoRA adapters (`lora/`) and MoE route recording (`moe/`) hooked into its layers;
- `sampling/`: per-sample logit bias, penalties, bans, warpers, seeded draws and log-probs, with structured outputs'
  token masks (`grammar/`);
- `speculative/`: draft tokens for the long tail's thin batches (the scheduler asks for them) and their verification
  (the step loop draws each position through the sampler);
- `weights/`: what a weight update may write, checked, copied in place and committed.
"""
