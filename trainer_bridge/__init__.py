"""The trainer side of rollout: `RolloutClient` to get completions from rollout workers (weight sync and the TRL
integration come next). Imports only `rollout.service.protocol` from the worker side."""

from trainer_bridge.client import Completion, Delta, GroupResult, PromptGroup, RolloutClient, RolloutError, WorkerBusy

__all__ = ["Completion", "Delta", "GroupResult", "PromptGroup", "RolloutClient", "RolloutError", "WorkerBusy"]
