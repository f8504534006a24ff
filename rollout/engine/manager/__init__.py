"""`ContinuousBatchingManager`: the engine on a background thread, as transformers' continuous batching has it.

- `continuous_batching.py`: the manager (the public face of what it holds) and `init_continuous_batching`;
  `context_manager.py`: transformers' `continuous_batching_context_manager`, as a function of the model;
- `parts.py`: what it holds, built around one mailbox and one lock (weak references back to the manager);
- `request_adding.py`: the manager's methods that queue requests (`add_request`, `add_groups`, `cancel_request`);
- `request_desk.py`: groups checked on the caller's thread and posted to the engine thread, all or none;
- `commands.py`: what other threads put in the engine thread's mailbox; `weight_queue.py`: weight updates on their
  way there; `pause.py`: the manager's pause; `generation_pause.py`: vLLM's pause of generation, across calls;
  `serving_control.py`: the control calls (that pause, prefix cache resets, adapter unloads);
- `engine_thread.py`: the engine thread, applying commands and stepping the engine;
- `results.py`: where outputs go (a queue callers read, or handlers); `result_reading.py`: the manager's methods that
  read them;
- `exit_stop.py`: managers still running at interpreter exit are stopped first.
"""

from rollout.engine.manager.context_manager import continuous_batching_context_manager
from rollout.engine.manager.continuous_batching import (
    ContinuousBatchingManager,
    QueueFullError,
    init_continuous_batching,
)

__all__ = [
    "ContinuousBatchingManager",
    "QueueFullError",
    "continuous_batching_context_manager",
    "init_continuous_batching",
]
