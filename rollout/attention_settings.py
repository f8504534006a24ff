"""A model's attention implementation as it was, to be put back exactly: each config's own (the top config, its
sub-configs at any depth, and the configs of submodels), since they may differ (a vision tower on "eager" beside a
text model on "sdpa"; a sub-config left at None). transformers' `set_attn_implementation(name)` with the top
config's name alone would write that name into every sub-config, and raise for a tower that supports only its own
("eager"-only audio encoders). Used wherever rollout switches a model's attention for a while: the engines' lease,
their build-time probe, the trainer's `batch_invariant` block."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionSettings:
    """Each config of a model and the attention implementation it holds itself (`_attn_implementation_internal`)."""

    entries: tuple[tuple[Any, Any], ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> AttentionSettings:
        """The settings `model` holds now.

        Args:
            model: a transformers model (its `config`, and any submodel's own config).
        """
        roots = [model.config, *(getattr(module, "config", None) for module in model.modules())]
        seen: dict[int, Any] = {}
        pending = deque(config for config in roots if hasattr(config, "_attn_implementation_internal"))
        while pending:
            config = pending.popleft()
            if id(config) in seen:
                continue
            seen[id(config)] = config
            for key in getattr(config, "sub_configs", None) or ():
                sub = getattr(config, key, None)
                if hasattr(sub, "_attn_implementation_internal"):
                    pending.append(sub)
        return cls(tuple((config, config._attn_implementation_internal) for config in seen.values()))

    def restore(self) -> None:
        """Give every config back its own implementation (the attention functions are looked up by that name at
        each forward: nothing else holds the switch)."""
        for config, implementation in self.entries:
            config._attn_implementation_internal = implementation
