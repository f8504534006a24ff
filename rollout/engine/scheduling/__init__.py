"""Scheduling, free of torch: which requests compute how many tokens each step, and their KV blocks.

- `scheduler.py`: the token-budget scheduler: its queues, and a step's results;
- `client_turns.py`: the waiting queue's order when several clients share the engine (they take turns);
- `step_builder.py`: one step's `ScheduledBatch` (`batch.py`), filled from the queues phase by phase (what it reads
  of the scheduler: `step_protocols.py`), reading the waiting queue through `waiting_cursor.py`;
- `admission.py`: which requests to admit, and which to preempt, under memory pressure;
- `express_lane.py`: a short request admitted past the growth reserve and past a queue head that does not fit;
- `suspects.py`: after a failed step, each of its groups' samples tried in steps of their own;
- `future_peak.py`: with known lengths, the most blocks the running requests will hold at once;
- `block_manager.py`: ref-counted KV blocks with chained prefix hashes and copy-on-write;
- `block_hash.py`: a block's prefix hash, keyed so that no client can aim at another's prefix;
- `block_holders.py`: who holds each block, so each request knows how many it holds alone.
"""
