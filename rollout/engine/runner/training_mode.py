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
    """Each submodule's training flag, and each kernelized transformers model's kernels mode (read on that model
    itself, wherever it sits: a peft model around it only forwards the attribute)."""

    flags: tuple[tuple[torch.nn.Module, bool], ...]
    kernels: tuple[tuple[torch.nn.Module, Any], ...] = ()

    @classmethod
    def of(cls, model: torch.nn.Module) -> TrainingMode:
        """The mode `model` is in now.

        Args:
            model: a torch module (a transformers model, or a peft model around one).
        """
        modules = list(model.modules())
        kernels = tuple((module, module.kernels_mode) for module in modules if _kernelized(module))
        return cls(tuple((module, module.training) for module in modules), kernels)

    def including(self, model: torch.nn.Module) -> TrainingMode:
        """This mode, with the modules of `model` it has not seen yet as they are now (a peft model built around a
        model already held adds its wrappers and adapter layers).

        Args:
            model: a module sharing some of its submodules with the recorded one.
        """
        seen = {id(module) for module, _ in self.flags}
        new = TrainingMode.of(model)
        flags = self.flags + tuple((module, flag) for module, flag in new.flags if id(module) not in seen)
        known = {id(module) for module, _ in self.kernels}
        return TrainingMode(flags, self.kernels + tuple(pair for pair in new.kernels if id(pair[0]) not in known))

    def restore(self) -> None:
        """Put every flag back, and a kernels mode the switch changed (kernelizing those layers again)."""
        for module, flag in self.flags:
            module.training = flag
        for module, mode in self.kernels:
            if module.kernels_mode != mode:
                module.kernels_mode = mode


def _kernelized(module: torch.nn.Module) -> bool:
    """A transformers model kernelized by the `kernels` library (its class defines `kernels_mode`)."""
    return isinstance(getattr(type(module), "kernels_mode", None), property) and module.use_kernels is True
