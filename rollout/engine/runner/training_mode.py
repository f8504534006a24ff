"""A model's training mode as it was, to be put back exactly after the engine switched it to eval mode (the
build-time probe, the lease): every submodule's own `training` flag, and, for a model kernelized with the `kernels`
library (`use_kernels=True`), the mode its layers were kernelized for.

Why each submodule's flag: a trainer may keep parts in eval mode (frozen embeddings, say), which `model.train(True)`
would switch on again. Why the kernels mode: transformers' `model.eval()` re-kernelizes a kernelized model for
inference, and setting the flags back does not kernelize it again, so a trainer would go on training with
inference kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TrainingMode:
    """Each submodule's training flag, and the kernels mode (None when the model is not kernelized)."""

    model: torch.nn.Module
    flags: tuple[tuple[torch.nn.Module, bool], ...]
    kernels_mode: Any = None

    @classmethod
    def of(cls, model: torch.nn.Module) -> TrainingMode:
        """The mode `model` is in now.

        Args:
            model: a torch module (a transformers model, or a peft model around one).
        """
        flags = tuple((module, module.training) for module in model.modules())
        kernelized = getattr(model, "use_kernels", False) is True
        return cls(model, flags, getattr(model, "kernels_mode", None) if kernelized else None)

    def restore(self) -> None:
        """Put every flag back, and the kernels mode when the switch changed it (kernelizing the layers again)."""
        for module, flag in self.flags:
            module.training = flag
        if self.kernels_mode is not None and getattr(self.model, "kernels_mode", None) != self.kernels_mode:
            self.model.kernels_mode = self.kernels_mode
