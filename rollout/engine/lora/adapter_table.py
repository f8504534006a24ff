"""LoRA adapters served unmerged, several side by side in one batch: a LoRA Linear's output is
W0 x + scaling * B (A x), the trainer's own computation (peft's) in any dtype, and the base weights are never
modified.

Layout: every base Linear an adapter targets gets, once, stacked weights for all `max_loras` slots,
A (max_loras * max_rank, in) and B (out, max_loras * max_rank) in fp32 (an adapter of lower rank leaves its extra
rows zero), per-slot scalings, and a forward hook. A step gives every token the slot of its request's adapter (or the
"base" slot, `max_loras`); the hook computes `x @ A.T`, zeroes the columns of other slots (one mask per forward,
shared by all layers), and adds `(that @ B.T) * scaling[slot]`: one gathered product per layer, the same shapes
every step, so decode CUDA graphs capture it.

Modules an adapter trains whole (peft's modules_to_save, the output head included) are served beside them
(`saved_modules.py`, `saved_head.py`).

Invariants:
- The hooks act only inside an engine step that needs them (`stepping`): a trainer's own forward of a shared model
  (colocated) never sees them. Without any adapter loaded there are no hooks at all.
- A base token's mask row is zero: its output gains an exact 0.
- `layout_version` changes whenever captured graphs would be stale (hooks added, the slot buffer grown): the runner
  then captures them again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rollout.config import FieldError, dtype_name
from rollout.engine.kv.transfer import to_device
from rollout.engine.lora.adapter_specs import check_tensor_specs
from rollout.engine.lora.adapter_weights import AdapterModules, LoraModule, SavedModule, to_named_tensors
from rollout.engine.lora.bounds import check_magnitudes, check_rank_limit, check_room
from rollout.engine.lora.layers import LoraLayer, LoraStepState
from rollout.engine.lora.saved_modules import SavedModules
from rollout.engine.requests.adapter_ref import AdapterRef, AdapterUnloaded, check_adapter_name
from rollout.peft_adapters import adapter_submodules

MAX_RETIRED = 64  # adapters whose reason for no longer being served is kept (past it the oldest is forgotten)


class AdapterTable:
    """The adapters one engine serves, by name, and their stacked weights."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_loras: int,
        max_rank: int,
        max_tokens: int,
        head_fp32: bool = False,
        batch_invariant: bool = False,
    ):
        """
        Args:
            model: the served model (its Linear layers are what adapters may target, with LoRA or whole; the output
                head only whole).
            max_loras: adapters served at once.
            max_rank: the highest rank accepted.
            max_tokens: the most tokens of one forward (the slot buffer grows past it if ever needed).
            head_fp32: the engine computes the output head in fp32 (`fp32_logits` on a bf16/fp16 model): so are
                adapters' copies of it.
            batch_invariant: compute each adapter's tokens as the trainer's `batch_invariant` forward does
                (`layers.py`), bit for bit.
        Raises:
            FieldError: ("max_lora_rank") above the rank any of the model's Linear layers can take.
        """
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        # By the base model's module names; in a peft-injected model a LoRA layer's Linear is its `base_layer`, and
        # peft's own layers (lora_A, lora_B, saved copies) are no targets: their rank-wide shapes would bound
        # max_lora_rank (a PEFT GPT-2, whose base layers are Conv1D, was refused at its LoRA's rank).
        added = adapter_submodules(model)
        self._linears = {
            name.removesuffix(".base_layer"): module
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head and id(module) not in added
        }
        self._head_names = {name for name, module in model.named_modules() if module is head and head is not None}
        self._device = next(model.parameters()).device
        # The narrowest floating dtype of the model: the one an adapter's delta must not overflow (lora_bounds.py).
        floating = [p.dtype for p in model.parameters() if p.is_floating_point()] or [torch.float32]
        self.dtype = min(floating, key=lambda dtype: torch.finfo(dtype).max)
        # Names an adapter may not take besides the base's reserved one (the worker adds the served model's name).
        self.reserved_names: set[str] = set()
        check_rank_limit(list(self._linears.values()), max_rank)  # before anything is allocated
        self.state = LoraStepState(max_loras, max_rank, max_tokens, self._device, batch_invariant)
        self._layers: dict[str, LoraLayer] = {}
        self.saved = SavedModules(model, head, self._head_names, self.state, head_fp32)
        self.refs: dict[str, AdapterRef] = {}
        self._ranks: dict[str, dict[str, int]] = {}  # each adapter's modules and their ranks
        # Adapters no longer served for a reason a request naming one is told (`unload`'s), newest last.
        self.retired: dict[str, str] = {}
        self.layout_version = 0

    @property
    def loaded(self) -> bool:
        """True once any adapter is served."""
        return bool(self.refs)

    def ref(self, name: str) -> AdapterRef:
        """The served adapter of this name (for a request).

        Raises:
            FieldError: ("adapter") an unknown name, listing the served ones.
        """
        ref = self.refs.get(name)
        if ref is None:
            check_adapter_name(name)
            if name in self.retired:
                raise FieldError("adapter", self.retired[name])
            served = sorted(self.refs) or "none"
            raise FieldError("adapter", f"no adapter named {name!r} is served (served: {served})")
        return ref

    # ---- loading ----------------------------------------------------------------------------------------------
    def check_specs(self, name: str, specs: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        """Check an adapter update's names, dtypes and shapes (wire names) before any byte of it arrives.

        Raises:
            FieldError: the culprit: the adapter name, a tensor (unknown module, wrong dtype or shape, rank above
                max_lora_rank), or max_loras when no slot is free.
        """
        check_adapter_name(name)
        if name in self.reserved_names:
            raise FieldError("adapter", f"{name!r} is the served model's name: give the adapter another one")
        if name not in self.refs and len(self.refs) >= self.max_loras:
            raise FieldError(
                "max_loras",
                f"{len(self.refs)} adapters are served already ({sorted(self.refs)}): push under one of those names "
                "(it replaces that adapter), start the worker with a larger --max-loras, or unload one "
                "(trainer_bridge.unload_adapter, the HTTP control route /v1/unload_lora_adapter, or "
                "Engine.unload_adapter in process)",
            )
        ranks, saved = check_tensor_specs(specs, self._linears, self._head_names, self.max_rank)
        self.saved.check_specs(saved)
        for module_name, *_ in saved.values():
            if module_name in ranks:
                raise FieldError(f"{module_name}.lora_A", "a module the adapter also saves whole (modules_to_save)")

    def check(self, name: str, modules: AdapterModules, check_finite: bool = False) -> None:
        """Check a whole adapter before anything changes: names, shapes and ranks (`check_specs`), magnitudes that
        could overflow the model's dtype (`lora_bounds.check_magnitudes`, always: an adapter whose samples turn to
        NaN would leave it in KV blocks), and room for the layers and saved-module copies it adds.

        Args:
            name: the adapter's name.
            modules: its modules.
            check_finite: also refuse non-finite entries anywhere (the magnitude check already refuses them in
                LoRA pairs and saved modules).
        Raises:
            FieldError: as `check_specs`; an overflowing scaling, lora_A, lora_B or saved parameter (named); a
                non-finite tensor; ("max_lora_rank") new layers, or ("modules_to_save") new copies of saved modules,
                that free memory cannot hold.
        """
        if not modules:
            raise FieldError("tensors", "an adapter brings at least one module's lora_A and lora_B")
        for module, weights in modules.items():
            if isinstance(weights, SavedModule) and not weights.params:
                raise FieldError(f"{module}.modules_to_save.weight", "missing: a saved module brings its parameters")
        tensors, _ = to_named_tensors(modules)
        self.check_specs(name, {wire: (dtype_name(t.dtype), tuple(t.shape)) for wire, t in tensors.items()})
        if check_finite:
            for wire, tensor in tensors.items():
                if not bool(torch.isfinite(tensor).all()):
                    raise FieldError(wire, "holds NaN or Inf")
        check_magnitudes(modules, self.dtype)
        new = [self._linears[m] for m, w in modules.items() if isinstance(w, LoraModule) and m not in self._layers]
        saved = [m for m, w in modules.items() if isinstance(w, SavedModule)]
        saved_bytes = self.saved.bytes_needed(self.refs[name].slot if name in self.refs else None, saved)
        if new or saved_bytes:
            check_room(new, self.max_loras, self.max_rank, self._device, repr(name), saved_bytes)

    def check_served(self, ref: AdapterRef) -> None:
        """Refuse a reference taken before its adapter was unloaded (and maybe another loaded under its name).

        Args:
            ref: a request's adapter, looked up at its intake.
        Raises:
            AdapterUnloaded: ("adapter") it is no longer the one served under its name.
        """
        if self.refs.get(ref.name) is not ref:
            unloaded = f"adapter {ref.name!r} was unloaded after this request was accepted"
            raise AdapterUnloaded("adapter", self.retired.get(ref.name, unloaded))

    def load(self, name: str, modules: dict[str, LoraModule], version: int) -> AdapterRef:
        """Serve `modules` as adapter `name` (replacing one of that name in its slot); the caller ran `check` first,
        before anything changed (`Engine.load_adapter`, between two steps).

        Returns:
            The adapter's reference (the same object as before when it replaced one).
        """
        ref = self.refs.get(name)
        slot = ref.slot if ref is not None else min(set(range(self.max_loras)) - {r.slot for r in self.refs.values()})
        pairs = {module: pair for module, pair in modules.items() if isinstance(pair, LoraModule)}
        saved = {module: copy for module, copy in modules.items() if isinstance(copy, SavedModule)}
        # First everything that allocates (a failure leaves what is served as it was: new layers add exact zeros),
        # then the writes.
        for module in pairs:
            if module not in self._layers:
                linear = self._linears[module]
                self._layers[module] = LoraLayer(module, linear, self.state, self.max_loras, self.max_rank)
                self.layout_version += 1
        shadows = self.saved.reserve(slot, saved)
        with torch.no_grad():
            for module, layer in self._layers.items():
                layer.write(slot, pairs.get(module))
        if self.saved.install(slot, saved, shadows):
            self.layout_version += 1
        if ref is None:
            ref = self.refs[name] = AdapterRef(name, slot, version)
            self.retired.pop(name, None)
        ref.version = version
        self._ranks[name] = {module: pair.rank for module, pair in pairs.items()}
        return ref

    def unload(self, name: str, reason: str | None = None) -> None:
        """Stop serving adapter `name`: its slot's weights are zeroed and the slot is free again; the caller ended
        its requests first (`Engine.unload_adapter`, between two steps).

        Args:
            name: the adapter.
            reason: why, for the requests that name it from now on until it is served again (None: the name is
                just unknown; the last `MAX_RETIRED` reasons are kept).
        Raises:
            FieldError: ("adapter") an unknown name.
        """
        slot = self.ref(name).slot
        with torch.no_grad():
            for layer in self._layers.values():
                layer.write(slot, None)
        if self.saved.install(slot, {}, {}):
            self.layout_version += 1
        del self.refs[name], self._ranks[name]
        self.retired.pop(name, None)
        if reason is not None:
            self.retired[name] = reason
            if len(self.retired) > MAX_RETIRED:
                del self.retired[next(iter(self.retired))]

    def modules_of(self, name: str) -> AdapterModules:
        """A copy of a served adapter's weights (as served: LoRA in fp32, saved modules in the model's dtype), e.g. to
        copy it to another worker.

        Raises:
            FieldError: ("adapter") an unknown name.
        """
        slot = self.ref(name).slot
        modules: AdapterModules = dict(self.saved.modules_of(slot))
        for module, rank in self._ranks[name].items():
            layer = self._layers[module]
            rows = slice(slot * self.max_rank, slot * self.max_rank + rank)
            scaling = float(layer.scalings[slot])
            modules[module] = LoraModule(layer.lora_A[rows].clone(), layer.lora_B[:, rows].clone(), scaling)
        return modules

    # ---- steps ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stepping(self, adapters: Sequence[AdapterRef | None], lengths: Sequence[int], always: bool) -> Iterator[None]:
        """Inside: the hooks act for one step's forward, each token in its request's slot.

        Args:
            adapters: each sequence's adapter (None: the base model).
            lengths: each sequence's tokens in the step.
            always: act even when no sequence has an adapter (decode graphs capture the LoRA path once for all).
        """
        if not self.refs or not (always or any(adapters)):
            yield
            return
        base = self.max_loras
        slots: list[int] = []
        for ref, length in zip(adapters, lengths):
            slots += [base if ref is None else ref.slot] * length
        held = self.state.token_slots.numel()
        # The first step with an adapter, or a graph capture (no sequence: its padding tokens, on the base, read the
        # buffer's first rows; warmup captures after --lora adapters are served): room for every later step.
        if len(slots) > held or (always and held == 0):
            size = max(len(slots), self.state.max_tokens)
            grown = torch.full((size,), base, dtype=torch.long, device=self._device)
            self.state.token_slots = grown
            self.layout_version += 1
        if slots:  # queued, never waited for (a device-side copy from pinned memory)
            self.state.token_slots[: len(slots)].copy_(to_device(slots, torch.long, self._device))
        self.state.active = True
        try:
            yield
        finally:
            self.state.active = False

    def new_forward(self, head_rows: torch.Tensor | None = None) -> None:
        """A forward begins (the model call, also inside a graph capture): the hooks build their mask anew.

        Args:
            head_rows: the packed token of each row the output head computes (None: every token).
        """
        self.state.new_forward(head_rows)

    def stats(self) -> dict[str, Any]:
        """Served adapters and their versions, for the worker's status."""
        return {name: {"version": ref.version, "slot": ref.slot} for name, ref in sorted(self.refs.items())}

    def close(self) -> None:
        """Remove the hooks and free the stacked weights (the model is as it was). Idempotent."""
        for layer in self._layers.values():
            layer.handle.remove()
        self._layers.clear()
        self.saved.close()
        self.refs.clear()
        self._ranks.clear()
        self.state.token_slots = torch.empty(0, dtype=torch.long)
