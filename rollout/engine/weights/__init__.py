"""Weight updates inside the engine, in the order one is applied:

- `weight_table.py`: every name an update may target, checked and copied in place;
- `weight_updates.py`: the engine's `WeightUpdates` (whole-model updates and LoRA adapters), each committed whole;
- `commit_modes.py`: what a commit does to the requests in flight ("recompute", "keep", ...).
- `engine_weights.py`: `EngineWeights`, the weights half of the `Engine`'s API (which it inherits).
"""
