"""One LoRA adapter's weights as the engine takes them, per base module (by its name in the served model):
- a `LoraModule` for a `torch.nn.Linear` it adapts: `lora_A` (r, in_features), `lora_B` (out_features, r) and the
  scaling peft applies (lora_alpha / r, or / sqrt(r) with rsLoRA, per module with rank_pattern / alpha_pattern);
- a `SavedModule` for a module it trains whole (peft's `modules_to_save`: a Linear, an Embedding or a norm over the
  hidden states, the output head included): the adapter's own parameters, which its tokens use instead of the base
  module's.

On the wire (adapter pushes) a LoRA module's tensors are named "<module>.lora_A" and "<module>.lora_B", with the
scalings beside them; a saved module's are "<module>.modules_to_save.<parameter>" ("weight", "bias"). A PEFT adapter
directory (adapter_config.json + adapter_model.safetensors) is read here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rollout.config import FieldError
from rollout.peft_adapters import (
    SAVED_MARKER,
    active_adapter_name,
    check_peft_config,
    holds_adapter,
    lora_layers,
    module_name,
    saved_modules,
)

WIRE_SUFFIXES = (".lora_A", ".lora_B")


@dataclass
class LoraModule:
    """The LoRA pair of one base Linear: its output gains scaling * lora_B @ lora_A @ x."""

    lora_A: torch.Tensor  # (r, in_features)
    lora_B: torch.Tensor  # (out_features, r)
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_A.shape[0]


@dataclass
class SavedModule:
    """A module the adapter trains whole (peft's modules_to_save): its tokens run the base module's own forward with
    these parameters ("weight", and "bias" where the module has one)."""

    params: dict[str, torch.Tensor]


AdapterModules = dict[str, "LoraModule | SavedModule"]


def saved_parameter(wire_name: str) -> tuple[str, str] | None:
    """(module, parameter) of a saved module's wire name ("<module>.modules_to_save.<parameter>"), else None."""
    module, marker, parameter = wire_name.rpartition(SAVED_MARKER)
    return (module, parameter) if marker and module and parameter and "." not in parameter else None


def from_named_tensors(tensors: dict[str, torch.Tensor], scalings: dict[str, float]) -> AdapterModules:
    """The adapter's modules from wire names ("<module>.lora_A" / "<module>.lora_B" with per-module scalings, and
    "<module>.modules_to_save.<parameter>").

    Raises:
        FieldError: naming a tensor with another name, a module missing one of its pair or its scaling, a pair
            whose ranks differ, a scaling that is not a finite number, or a module both adapted and saved.
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    modules: AdapterModules = {}
    for name, tensor in tensors.items():
        saved = saved_parameter(name)
        if saved is not None:
            module = modules.setdefault(saved[0], SavedModule({}))
            module.params[saved[1]] = tensor
            continue
        suffix = next((s for s in WIRE_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            raise FieldError(
                name,
                f"an adapter tensor is named '<module>.lora_A', '<module>.lora_B' or '<module>{SAVED_MARKER}<parameter>'",
            )
        pairs.setdefault(name[: -len(suffix)], {})[suffix[1:]] = tensor
    for module, pair in pairs.items():
        for part in ("lora_A", "lora_B"):
            if part not in pair:
                raise FieldError(f"{module}.{part}", "missing: every module brings both lora_A and lora_B")
        scaling = scalings.get(module)
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
            raise FieldError(f"scalings.{module}", f"must be a finite number, got {scaling!r}")
        lora_A, lora_B = pair["lora_A"], pair["lora_B"]
        if lora_A.dim() != 2 or lora_B.dim() != 2 or lora_A.shape[0] != lora_B.shape[1]:
            raise FieldError(
                f"{module}.lora_B",
                f"lora_A {list(lora_A.shape)} and lora_B {list(lora_B.shape)} are not an (r, in) / (out, r) pair",
            )
        if module in modules:
            raise FieldError(f"{module}.lora_A", "a module the adapter also saves whole (modules_to_save)")
        modules[module] = LoraModule(lora_A, lora_B, float(scaling))
    extra = sorted(set(scalings) - set(pairs))
    if extra:
        raise FieldError(f"scalings.{extra[0]}", "a scaling for a module the adapter brings no tensors for")
    return modules


def is_adapter_tensor(name: str, scalings: dict[str, float]) -> bool:
    """True for the wire name of an adapter's tensor (a LoRA tensor of a module with a scaling, or a saved module's
    parameter), False for a base weight travelling with it."""
    module, _, part = name.rpartition(".")
    return (part in ("lora_A", "lora_B") and module in scalings) or saved_parameter(name) is not None


def split_adapter_tensors(
    tensors: dict[str, torch.Tensor], scalings: dict[str, float]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """(the adapter's tensors, the base weights that travel with them, or None): an adapter update may bring the
    whole base along (a worker that does not serve the trainer's base yet)."""
    adapter = {name: tensor for name, tensor in tensors.items() if is_adapter_tensor(name, scalings)}
    base = {name: tensor for name, tensor in tensors.items() if name not in adapter}
    return adapter, base or None


def to_named_tensors(modules: AdapterModules) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The wire form of an adapter: (tensors by wire name, scalings by LoRA module)."""
    tensors, scalings = {}, {}
    for module, weights in modules.items():
        if isinstance(weights, SavedModule):
            tensors.update({f"{module}{SAVED_MARKER}{part}": value for part, value in weights.params.items()})
            continue
        tensors[f"{module}.lora_A"] = weights.lora_A
        tensors[f"{module}.lora_B"] = weights.lora_B
        scalings[module] = weights.scaling
    return tensors, scalings


def load_peft_dir(path: str) -> AdapterModules:
    """Read a PEFT LoRA adapter directory (as `PeftModel.save_pretrained` writes it), with peft's own loaders.

    Args:
        path: the directory.
    Raises:
        FieldError: ("lora") a directory peft cannot read, or an adapter that cannot be served unmerged (named).
    """
    try:
        from peft import LoraConfig
        from peft.utils import load_peft_weights
        from peft.utils.other import get_pattern_key
    except ImportError:
        raise FieldError("lora", "loading adapter directories needs peft: pip install 'rollout[lora]'") from None
    try:
        config = LoraConfig.from_pretrained(path)
        state = load_peft_weights(path, device="cpu")
    except Exception as error:  # noqa: BLE001 - a missing or broken directory, named
        raise FieldError("lora", f"cannot read the PEFT adapter at {path!r}: {error}") from None
    check_peft_config(config)
    tensors: dict[str, torch.Tensor] = {}
    saved = tuple(config.modules_to_save or ())
    # With ensure_weight_tying peft saves the copy of a module tied to a saved one (the output head tied to the
    # input embeddings) under the tied module's name, which modules_to_save does not list.
    tied = bool(getattr(config, "ensure_weight_tying", False))
    for key, tensor in state.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.weight"
            if key.endswith(marker):
                tensors[f"{module_name(key[: -len(marker)])}.{part}"] = tensor
                break
        else:
            module, _, parameter = module_name(key).rpartition(".")
            if not tied and not any(module == target or module.endswith(f".{target}") for target in saved):
                raise FieldError("lora", f"{key}: neither a LoRA A/B weight nor one of modules_to_save {list(saved)}")
            tensors[f"{module}{SAVED_MARKER}{parameter}"] = tensor
    scalings = {}
    for name in {key.rsplit(".", 1)[0] for key in tensors if saved_parameter(key) is None}:
        rank = tensors[f"{name}.lora_A"].shape[0]
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), name), config.lora_alpha)
        scalings[name] = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
    return from_named_tensors(tensors, scalings)


def from_peft_model(model: Any, adapter_name: str | None = None) -> AdapterModules:
    """One adapter of a live PEFT model, as the engine takes it (the model's own tensors, not copies; ZeRO-3 or
    FSDP shards must be gathered by the caller).

    Args:
        model: a `peft.PeftModel` (or its LoRA-injected base).
        adapter_name: which adapter (None: the active one).
    Raises:
        FieldError: an unknown adapter, or one that cannot be served unmerged (DoRA, a LoRA bias, a non-Linear
            target, ...), named.
    """
    name = adapter_name or active_adapter_name(model)
    configs = getattr(model, "peft_config", {}) or {}
    if name not in configs:
        raise FieldError("adapter_name", f"the model has no adapter {name!r} (it has {sorted(configs)})")
    check_peft_config(configs[name])
    modules: AdapterModules = {}
    for key, copy in saved_modules(model, name):
        modules[module_name(key)] = SavedModule({part: p.detach() for part, p in copy.named_parameters()})
    for key, layer in lora_layers(model):
        if not holds_adapter(layer, name):
            continue
        target = module_name(key)
        if layer.use_dora.get(name):
            raise FieldError(target, "DoRA is not served unmerged; push with adapters='merged'")
        if not isinstance(layer.get_base_layer(), torch.nn.Linear) or getattr(layer, "fan_in_fan_out", False):
            kind = type(layer.get_base_layer()).__name__
            raise FieldError(target, f"LoRA on a {kind} is not served unmerged (only torch.nn.Linear layers)")
        if getattr(layer, "lora_bias", {}).get(name):
            raise FieldError(target, "a trained LoRA bias is not served unmerged; push with adapters='merged'")
        lora_A, lora_B = layer.lora_A[name].weight.detach(), layer.lora_B[name].weight.detach()
        modules[target] = LoraModule(lora_A, lora_B, float(layer.scaling[name]))
    if not modules:
        raise FieldError("adapter_name", f"adapter {name!r} has no LoRA layer")
    return modules
