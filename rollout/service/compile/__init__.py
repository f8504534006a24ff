"""Structured-output constraints compiled off the serving loop, within a time and memory budget, in the order a
compile passes: `constraint_compiles.py` (the worker's compile slots, taking turns by client: `fair_queue.py`),
`jobs.py` (a job and its budget), `link.py` (the worker's side of the compile server), `frames.py` (the frames between
them), `server.py` (the compile server process) and `child.py` (its forked children, one compile each)."""
