"""Modules an adapter trains whole (peft's `modules_to_save`: a Linear, an Embedding, e.g. the input embeddings
after adding tokens, or a norm over the hidden states), served beside the LoRA layers of `lora.AdapterTable`: the base module keeps its weights, and
the tokens of an adapter that saves it get the output of the module's own forward run with the adapter's copy of
its parameters, as peft's `ModulesToSaveWrapper` computes it (its mixed-batch forward included).

Each saved module gets a forward hook once; per adapter slot that saves it, a shadow of the module (a shallow copy
with its own parameters, in the base module's dtype, on its device) holds the copy. In a step, the hook runs each
shadow's forward (on every token: the same shapes every step, so decode graphs capture it) and takes its rows for
that slot's tokens. A load first reserves everything it allocates, then writes (`reserve`, `install`): a load that
fails changes nothing served.

The output head is saved the same way, with a hook of its own (`saved_head.py`): its rows are the rows the step
samples or scores, not its tokens, and it follows the engine's fp32 head.
"""

from __future__ import annotations

import copy

import torch

from rollout.config import FieldError
from rollout.engine.lora.adapter_weights import SavedModule
from rollout.engine.lora.layers import LoraStepState
from rollout.engine.lora.saved_head import SavedHead
from rollout.peft_adapters import hidden_width, saved_module_refusal

SAVED_DTYPES = {"float32", "bfloat16", "float16"}


class _SavedLayer:
    """One saved module's hook and, per slot that saves it, a shadow of the module holding the slot's copy."""

    dtype = None  # the shadows keep the module's dtype

    def __init__(self, name: str, module: torch.nn.Module, state: LoraStepState):
        self.name = name
        self.source = module  # what the shadows copy
        self.state = state  # whether hooks act, each token's slot
        self.shadows: dict[int, torch.nn.Module] = {}
        self.handle = module.register_forward_hook(self)

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not self.state.active or not self.shadows:
            return None
        slots = self.state.slots_for(output.shape[-2], self.name).unsqueeze(-1)  # tokens are the output's rows
        for slot, shadow in self.shadows.items():
            # The shadow's own forward (the module's code, e.g. an embedding's padding_idx or scale) over the copy;
            # the served module is never touched, so other threads reading its parameters see the base. A Linear's
            # is the table's linear (row-invariant with batch_invariant, as the trainer's copy computes).
            if type(shadow) is torch.nn.Linear:
                theirs = self.state.linear(args[0], shadow.weight, shadow.bias)
            else:
                theirs = shadow.forward(*args)
            output = torch.where(slots == slot, theirs, output)
        return output


def _shadow(module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A shallow copy of `module` (sharing its buffers and settings) with parameters of its own, uninitialized, in
    `dtype` (None: the module's)."""
    shadow = copy.copy(module)
    shadow._parameters = {  # noqa: SLF001 - a private dict of torch's, replaced so the original keeps its own
        name: None if tensor is None else torch.nn.Parameter(torch.empty_like(tensor, dtype=dtype), requires_grad=False)
        for name, tensor in module._parameters.items()  # noqa: SLF001 - None entries too (a Linear without bias)
    }
    return shadow


class SavedModules:
    """The saved modules of one adapter table."""

    def __init__(
        self,
        model: torch.nn.Module,
        head: torch.nn.Module | None,
        head_names: set[str],
        state: LoraStepState,
        head_fp32: bool = False,
    ):
        """
        Args:
            model: the served model.
            head: its output embeddings (None: it has none).
            head_names: the head's module names.
            state: the table's `LoraStepState`.
            head_fp32: the engine computes the head in fp32 (`fp32_logits` on a bf16/fp16 model).
        """

        def in_head(name: str) -> bool:
            return any(name == head_name or name.startswith(f"{head_name}.") for head_name in head_names)

        # By the base model's module names; in a peft-wrapped model the frozen module is `original_module`. The
        # head (and what a peft wrapper of it holds) is served by its own hook.
        self._hidden = hidden_width(model)
        self._modules = {
            name.removesuffix(".original_module"): module for name, module in model.named_modules() if not in_head(name)
        }
        self._head = head
        # The head's Linear: the head itself, or the frozen original a peft wrapper holds (None: not a Linear).
        linear = getattr(head, "original_module", head)
        self._head_linear = linear if isinstance(linear, torch.nn.Linear) else None
        self._head_names = head_names
        self._head_fp32 = head_fp32
        self._state = state
        self._layers: dict[str, _SavedLayer | SavedHead] = {}

    def _module(self, name: str) -> torch.nn.Module | None:
        """The module a saved copy named `name` replaces (the head's Linear for the head), None if none."""
        return self._head_linear if name in self._head_names else self._modules.get(name)

    def check_specs(self, specs: dict[str, tuple[str, str, tuple[int, ...]]]) -> None:
        """Check saved parameters before any byte arrives: wire name -> (module, parameter, dtype, shape).

        Raises:
            FieldError: naming the tensor: no such module, one not served unmerged (`saved_module_refusal`; an
                output head that is not a Linear), no such parameter, a dtype or shape other than the base module's.
        """
        brought: dict[str, set[str]] = {}
        for wire_name, (module_name, parameter, dtype, shape) in specs.items():
            brought.setdefault(module_name, set()).add(parameter)
            module = self._module(module_name)
            if module is None:
                if module_name in self._head_names:
                    kind = type(self._head).__name__
                    raise FieldError(wire_name, f"the output head is a {kind}, not a torch.nn.Linear: push merged")
                raise FieldError(wire_name, f"the model has no module named {module_name!r}")
            refusal = None if module_name in self._head_names else saved_module_refusal(module, self._hidden)
            if refusal is not None:
                raise FieldError(wire_name, refusal)
            base = dict(module.named_parameters(recurse=False)).get(parameter)
            if base is None:
                raise FieldError(wire_name, f"{type(module).__name__} {module_name!r} has no parameter {parameter!r}")
            if dtype not in SAVED_DTYPES:
                raise FieldError(wire_name, f"dtype {dtype}: saved modules come in {sorted(SAVED_DTYPES)}")
            if tuple(shape) != tuple(base.shape):
                raise FieldError(wire_name, f"shape {list(shape)}: the module's {parameter} is {list(base.shape)}")
        for module_name, parameters in brought.items():
            for parameter in dict(self._module(module_name).named_parameters(recurse=False)):
                if parameter not in parameters:
                    raise FieldError(
                        f"{module_name}.modules_to_save.{parameter}",
                        "missing: a saved module brings every parameter of the module",
                    )

    def bytes_needed(self, slot: int | None, names: list[str]) -> int:
        """Bytes the copies of modules `names` (checked: `check_specs`) would allocate in `slot` (None: a slot not
        served yet); a copy the slot holds already is rewritten in place."""
        total = 0
        for name in names:
            layer = self._layers.get(name)
            if layer is not None and slot is not None and slot in layer.shadows:
                continue
            dtype = torch.float32 if name in self._head_names and self._head_fp32 else None
            total += sum(p.numel() * (dtype or p.dtype).itemsize for p in self._module(name).parameters(recurse=False))
        return total

    def reserve(self, slot: int, modules: dict[str, SavedModule]) -> dict[str, torch.nn.Module]:
        """Allocate what `modules` need in `slot` (hooks, new shadows) without serving any of it yet: a failure here
        (out of memory) changes nothing served. Returns the shadows to `install`."""
        shadows = {}
        for name in modules:
            if name not in self._layers:  # a hook with no shadow changes nothing
                self._layers[name] = self._new_layer(name)
            layer = self._layers[name]
            shadow = layer.shadows.get(slot)
            shadows[name] = shadow if shadow is not None else _shadow(layer.source, layer.dtype)
        return shadows

    def _new_layer(self, name: str) -> _SavedLayer | SavedHead:
        if name in self._head_names:
            return SavedHead(name, self._head, self._head_linear, self._state, self._head_fp32)
        return _SavedLayer(name, self._modules[name], self._state)

    def install(self, slot: int, modules: dict[str, SavedModule], shadows: dict[str, torch.nn.Module]) -> bool:
        """Write `modules` into their reserved shadows and serve them in `slot` (dropping the slot's others).
        Returns True when captured graphs are stale (a shadow added or dropped); one rewritten in place keeps them."""
        changed = False
        with torch.no_grad():
            for name, saved in modules.items():
                shadow = shadows[name]
                for part, target in shadow.named_parameters(recurse=False):
                    target.copy_(saved.params[part])
                layer = self._layers[name]
                changed |= layer.shadows.get(slot) is not shadow
                layer.shadows[slot] = shadow
        for name, layer in self._layers.items():
            if name not in modules and layer.shadows.pop(slot, None) is not None:
                changed = True
        return changed

    def modules_of(self, slot: int) -> dict[str, SavedModule]:
        """Copies of the slot's saved modules."""
        return {
            name: SavedModule({part: p.detach().clone() for part, p in layer.shadows[slot].named_parameters()})
            for name, layer in self._layers.items()
            if slot in layer.shadows
        }

    def close(self) -> None:
        """Remove the hooks and free the copies. Idempotent."""
        for layer in self._layers.values():
            layer.handle.remove()
            layer.shadows.clear()
        self._layers.clear()
