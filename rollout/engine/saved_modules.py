"""Modules an adapter trains whole (peft's `modules_to_save`: a Linear or an Embedding, e.g. the input embeddings
after adding tokens), served beside the LoRA layers of `lora.AdapterTable`: the base module keeps its weights, and
the tokens of an adapter that saves it get the output of the module's own forward run with the adapter's copy of
its parameters, as peft's `ModulesToSaveWrapper` computes it (its mixed-batch forward included).

Each saved module gets a forward hook once; per adapter slot that saves it, the copy's parameters are kept in the
base module's dtype, on its device. In a step, the hook runs the module's forward once per such slot (on every
token: the same shapes every step, so decode graphs capture it) and takes those rows for that slot's tokens.
`layout_changed` after `load` tells the table that captured graphs are stale (a slot's copy added or dropped).

The output head is not served this way (the engine computes it in fp32 itself): push such adapters merged.
"""

from __future__ import annotations

import torch

from rollout.config import FieldError
from rollout.engine.lora_weights import SavedModule

SAVED_DTYPES = {"float32", "bfloat16", "float16"}
SAVED_KINDS = (torch.nn.Linear, torch.nn.Embedding)


class _SavedLayer:
    """One saved module's hook and the copies of the slots that save it."""

    def __init__(self, module: torch.nn.Module, state: object):
        self.state = state  # lora.LoraStepState: whether hooks act, each token's slot
        self.copies: dict[int, dict[str, torch.Tensor]] = {}
        self._inside = False  # the hook runs the module's forward itself: not again from there
        self.handle = module.register_forward_hook(self)

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not self.state.active or self._inside or not self.copies:
            return None
        slots = self.state.token_slots[: output.shape[-2]].unsqueeze(-1)  # tokens are the rows of the output
        for slot, params in self.copies.items():
            self._inside = True
            try:
                replaced = torch.func.functional_call(module, params, args)
            finally:
                self._inside = False
            output = torch.where(slots == slot, replaced, output)
        return output


class SavedModules:
    """The saved modules of one adapter table."""

    def __init__(self, model: torch.nn.Module, head_names: set[str], state: object):
        """
        Args:
            model: the served model.
            head_names: its output head's module names (refused).
            state: the table's `LoraStepState`.
        """
        # By the base model's module names; in a peft-wrapped model the frozen module is `original_module`.
        self._modules = {
            name.removesuffix(".original_module"): module
            for name, module in model.named_modules()
            if isinstance(module, SAVED_KINDS) and name not in head_names
        }
        self._head_names = head_names
        self._state = state
        self._layers: dict[str, _SavedLayer] = {}

    def check_specs(self, specs: dict[str, tuple[str, str, tuple[int, ...]]]) -> None:
        """Check saved parameters before any byte arrives: wire name -> (module, parameter, dtype, shape).

        Raises:
            FieldError: naming the tensor: no such Linear or Embedding (or the output head), no such parameter, a
                dtype or shape other than the base module's.
        """
        brought: dict[str, set[str]] = {}
        for wire_name, (module_name, parameter, dtype, shape) in specs.items():
            brought.setdefault(module_name, set()).add(parameter)
            module = self._modules.get(module_name)
            if module is None:
                if module_name in self._head_names:
                    raise FieldError(
                        wire_name,
                        "modules_to_save on the output head is not served unmerged; push with adapters='merged'",
                    )
                raise FieldError(wire_name, f"the model has no Linear or Embedding named {module_name!r}")
            base = dict(module.named_parameters(recurse=False)).get(parameter)
            if base is None:
                raise FieldError(wire_name, f"{type(module).__name__} {module_name!r} has no parameter {parameter!r}")
            if dtype not in SAVED_DTYPES:
                raise FieldError(wire_name, f"dtype {dtype}: saved modules come in {sorted(SAVED_DTYPES)}")
            if tuple(shape) != tuple(base.shape):
                raise FieldError(wire_name, f"shape {list(shape)}: the module's {parameter} is {list(base.shape)}")
        for module_name, parameters in brought.items():
            for parameter in dict(self._modules[module_name].named_parameters(recurse=False)):
                if parameter not in parameters:
                    raise FieldError(
                        f"{module_name}.modules_to_save.{parameter}",
                        "missing: a saved module brings every parameter of the module",
                    )

    def load(self, slot: int, modules: dict[str, SavedModule]) -> bool:
        """Make `modules` the copies of `slot` (dropping the slot's others). Returns True when captured graphs are
        stale (a hook or a copy added or dropped); a copy replaced in place keeps them."""
        changed = False
        for name, saved in modules.items():
            if name not in self._layers:
                self._layers[name] = _SavedLayer(self._modules[name], self._state)
            layer, base = self._layers[name], self._modules[name]
            copy = layer.copies.get(slot)
            if copy is None:
                copy = layer.copies[slot] = {p: torch.empty_like(t) for p, t in base.named_parameters(recurse=False)}
                changed = True
            with torch.no_grad():
                for part, target in copy.items():
                    target.copy_(saved.params[part])
        for name, layer in self._layers.items():
            if name not in modules and layer.copies.pop(slot, None) is not None:
                changed = True
        return changed

    def modules_of(self, slot: int) -> dict[str, SavedModule]:
        """Copies of the slot's saved modules."""
        return {
            name: SavedModule({part: tensor.clone() for part, tensor in layer.copies[slot].items()})
            for name, layer in self._layers.items()
            if slot in layer.copies
        }

    def close(self) -> None:
        """Remove the hooks and free the copies. Idempotent."""
        for layer in self._layers.values():
            layer.handle.remove()
            layer.copies.clear()
        self._layers.clear()
