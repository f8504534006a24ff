"""rollout: an RL rollout generation service for GRPO trainers.

The in-process API mirrors transformers' continuous batching:

    from rollout import generate_batch, SamplingParams
    outputs = generate_batch(model, [[1, 2, 3]], sampling=SamplingParams(temperature=0.8, seed=0), max_new_tokens=32)
"""

from rollout.config import ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import Engine, GenerationOutput
from rollout.engine.manager import (
    ContinuousBatchingManager,
    QueueFullError,
    generate_batch,
    init_continuous_batching,
)

__all__ = [
    "ContinuousBatchingConfig",
    "ContinuousBatchingManager",
    "Engine",
    "GenerationOutput",
    "QueueFullError",
    "SamplingParams",
    "generate_batch",
    "init_continuous_batching",
]
__version__ = "0.1.0"
