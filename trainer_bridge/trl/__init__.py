"""TRL's GRPOTrainer generating through rollout (`RolloutGRPOTrainer`), in the order a training step uses it:
`trainer.py` (the trainer subclass and `RolloutGeneration`, TRL's vLLM path with rollout behind it), `settings.py`
(the GRPOConfig fields and modes checked), `server_mode.py` (the client to the workers and the backend for the
settings), `generation.py` (rows to groups and back) with `restarted_workers.py` (a round's workers restarted
after the push: the weights pushed again), `partial.py` (partial rollouts across rounds), `routes.py`
(MoE routing replay in the training forward), `async_mode.py` and `colocated_mode.py` (the asynchronous and
colocated modes)."""

from trainer_bridge.trl.trainer import (
    SUPPORTED_TRL,
    RolloutGeneration,
    RolloutGRPOTrainer,
    RolloutRows,
    check_trl_internals,
)

__all__ = ["SUPPORTED_TRL", "RolloutGRPOTrainer", "RolloutGeneration", "RolloutRows", "check_trl_internals"]
