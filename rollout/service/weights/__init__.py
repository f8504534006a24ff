"""Weight updates on the worker, as transactions, in the order an update passes: `spec_answers.py` (what an update
may target), `update_slot.py` (the one update open at a time, driven by the serving loop; `update_turn.py`: who may take it,
a begin against the open update and a checkpoint committed over HTTP against both; `served_base.py`: the names of
the base it serves), `adapter_checks.py` (what a LoRA adapter's update must be),
`staged_update.py` (begin, buckets staged and checked, commit into the engine), `commit_reply.py` (the engine's
outcome of a commit as its reply), `preparing.py` (each update's staging area made off the serving loop, one at a
time), `jobs.py` (the update's background thread: staging, hashing and checks off the serving loop),
`update_counts.py` (updates refused, bytes and pauses committed: stats()); beside the slot, `adapter_unloads.py` (a
served adapter's unload, answered without waiting on the engine)."""
