"""The continuous-batching engine, in process. One request crosses these files in this order:

- `intake.py`: a prompt and its settings checked and resolved into a group's leader `Request` (`request.py`);
- `manager.py`: `ContinuousBatchingManager`, the caller side; `engine_loop.py` its engine thread, fed through a
  mailbox of typed commands (`commands.py`; `pause.py`, `results.py`, `weight_queue.py`);
- `engine.py`: `Engine.step()`, schedule -> run -> sample -> update, and the outputs (`outputs.py`); `warmup.py`
  and `counters.py` act on a whole engine from outside its loop;
- `scheduler.py` and `block_manager.py`: which requests compute how many tokens (a `ScheduledBatch`, `batch.py`),
  and their KV blocks (no torch);
- `model_runner.py`: a `ScheduledBatch` as tensors through the model, over the paged cache (`kv_cache.py`,
  `block_tables.py`, `attention.py`, `triton_attention.py`, `cuda_graphs.py`, `transfer.py`);
- `sampler.py`: per-request penalties and bans (`token_bans.py`), warpers (`warpers.py`), seeded draws, logprobs,
  over each sample's parameters held in persistent per-slot device tables (`sampling_slots.py`);
- `weight_table.py`: what a weight update may write, checked and copied in place;
- `generate.py`: `generate_batch`, the one-call API over a cached engine.
"""
