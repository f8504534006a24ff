"""rollout: an RL rollout generation service for GRPO trainers.

The in-process API mirrors transformers' continuous batching:

    from rollout import generate_batch, SamplingParams
    outputs = generate_batch(model, [[1, 2, 3]], sampling=SamplingParams(temperature=0.8, seed=0), max_new_tokens=32)

Names are imported lazily, so `import rollout.protocol` (all a trainer-side client needs) does not pull in
torch, transformers or the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

from rollout import moved_modules

moved_modules.install()  # old import paths of moved modules keep working, with a DeprecationWarning

_EXPORTS = {
    "ContinuousBatchingConfig": "rollout.config",
    "FieldError": "rollout.config",
    "SamplingParams": "rollout.config",
    "Engine": "rollout.engine.engine",
    "GenerationOutput": "rollout.engine.requests.outputs",
    "ContinuousBatchingManager": "rollout.engine.manager.continuous_batching",
    "QueueFullError": "rollout.engine.manager.request_desk",
    "GroupSpec": "rollout.engine.requests.group_spec",
    "generate_batch": "rollout.engine.generate",
    "init_continuous_batching": "rollout.engine.manager.continuous_batching",
    "continuous_batching_context_manager": "rollout.engine.manager.context_manager",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
