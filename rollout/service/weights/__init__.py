"""Weight updates on the worker, as transactions, in the order an update passes: `update_slot.py` (the one update
open at a time, driven by the serving loop), `adapter_checks.py` (what a LoRA adapter's update must be),
`staged_update.py` (begin, buckets staged and checked, commit into the engine), `jobs.py` (the update's background
thread: hashing and checks off the serving loop)."""
