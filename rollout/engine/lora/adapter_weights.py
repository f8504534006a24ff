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

import dataclasses
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from rollout.config import FieldError
from rollout.engine.lora.adapter_files import check_adapter_files, check_known_settings
from rollout.peft_adapters import (
    SAVED_MARKER,
    active_adapter_name,
    base_model_mismatch,
    base_rewriting_init,
    check_peft_config,
    holds_adapter,
    lora_layers,
    module_name,
    saved_modules,
)

WIRE_SUFFIXES = (".lora_A", ".lora_B")
logger = logging.getLogger(__name__)


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


def load_peft_dir(path: str, served_base: str | None = None) -> AdapterModules:
    """Read a PEFT LoRA adapter directory (as `PeftModel.save_pretrained` writes it), with peft's own loaders.

    Args:
        path: the directory.
        served_base: the served model's `name_or_path`: an adapter whose `base_model_name_or_path` names another
            model is served with a warning naming both (`base_model_mismatch`).
    Raises:
        FieldError: ("lora") a directory peft cannot read; a malformed adapter_config.json setting (named); a tensor
            that is neither a LoRA pair's nor a saved module's (LoRA on an embedding, base weights saved beside the
            adapter), or an adapter that cannot be served unmerged (named).
    """
    try:
        from peft import LoraConfig
        from peft import __version__ as peft_version
        from peft.utils import load_peft_weights
    except ImportError:
        raise FieldError("lora", "loading adapter directories needs peft: pip install 'rollout[lora]'") from None
    check_adapter_files(path)
    check_known_settings(path, {field.name for field in dataclasses.fields(LoraConfig)}, peft_version)
    try:
        config = LoraConfig.from_pretrained(path)
        state = load_peft_weights(path, device="cpu")
    except Exception as error:  # noqa: BLE001 - a missing or broken directory, named
        raise FieldError("lora", f"cannot read the PEFT adapter at {path!r}: {error}") from None
    check_peft_config(config)
    mismatch = base_model_mismatch(getattr(config, "base_model_name_or_path", None), served_base)
    if mismatch is not None:
        logger.warning("LoRA adapter at %r: %s", path, mismatch)
    init = base_rewriting_init(config)
    if init is not None:  # peft's from_pretrained runs the init again over the base; the directory holds no base
        raise FieldError(
            "init_lora_weights",
            f"{init!r} rewrites the base weights when peft builds the model, and this adapter adds to that rewritten "
            "base, which is not served: save it with save_pretrained(..., path_initial_model_for_weight_conversion="
            "DIR) (peft turns it into a plain LoRA over the original base, of twice the rank), or push it with "
            "push_weights (which sends the rewritten base)",
        )
    tensors: dict[str, torch.Tensor] = {}
    saved = config.modules_to_save or ()
    saved = (saved,) if isinstance(saved, str) else tuple(saved)
    # With ensure_weight_tying peft saves the copy of a module tied to a saved one (the output head tied to the
    # input embeddings) under the tied module's name, which modules_to_save does not list.
    tied = bool(getattr(config, "ensure_weight_tying", False))
    _refuse_unserved_layers(state)
    for key, tensor in state.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.weight"
            if key.endswith(marker):
                tensors[f"{module_name(key[: -len(marker)])}.{part}"] = tensor
                break
        else:
            module, _, parameter = module_name(key).rpartition(".")
            # peft's own match for modules_to_save: the module's name ends with the entry ("layernorm" saves every
            # input_layernorm and post_attention_layernorm), no dot needed.
            if not tied and not any(isinstance(target, str) and module.endswith(target) for target in saved):
                raise FieldError(
                    "lora",
                    f"{key}: neither a LoRA A/B weight nor one of modules_to_save {list(saved)} (base weights saved "
                    "beside the adapter, as save_embedding_layers does for a resized vocabulary, are not served "
                    "unmerged)",
                )
            tensors[f"{module}{SAVED_MARKER}{parameter}"] = tensor
    scalings = {}
    for name in {key.rsplit(".", 1)[0] for key in tensors if saved_parameter(key) is None}:
        if f"{name}.lora_A" in tensors:  # else from_named_tensors names the missing half
            scalings[name] = _dir_scaling(config, name, tensors[f"{name}.lora_A"].shape[0])
    return from_named_tensors(tensors, scalings)


def _refuse_unserved_layers(state: dict[str, torch.Tensor]) -> None:
    """Refuse, naming the module, a directory's LoRA on an embedding (`lora_embedding_A` / `_B`), then the base
    weights peft saves beside LoRA on an embedding or the output head (`save_embedding_layers`: `<module>.base_layer.*`).

    Raises:
        FieldError: the module.
    """
    names = [module_name(key).rpartition(".")[::2] for key in state]
    for module, parameter in names:
        if parameter.startswith("lora_embedding_"):
            raise FieldError(module, "LoRA on an Embedding is not served unmerged (only torch.nn.Linear layers)")
    for module, _ in names:
        if module == "base_layer" or module.endswith(".base_layer"):
            raise FieldError(
                module.removesuffix("base_layer").removesuffix("."),
                "the adapter saves this layer's base weights (peft's save_embedding_layers, for LoRA on an "
                "embedding or the output head): not served unmerged",
            )


def _dir_setting(config: Any, field: str, pattern_field: str, name: str) -> tuple[str, Any]:
    """(the setting's name, its value) for module `name` of an adapter config: its `pattern_field` entry whose
    pattern matches `name` (peft's `get_pattern_key`), else `field`.

    Raises:
        FieldError: a pattern field that is not an object of regular expressions.
    """
    from peft.utils.other import get_pattern_key

    pattern = getattr(config, pattern_field, None) or {}
    if not isinstance(pattern, dict):
        raise FieldError(pattern_field, f"must be an object of module patterns, got {pattern!r}")
    try:
        key = get_pattern_key(list(pattern), name)
    except (re.error, TypeError) as error:
        raise FieldError(pattern_field, f"a key is not a regular expression: {error}") from None
    return (f"{pattern_field}.{key}", pattern[key]) if key in pattern else (field, getattr(config, field, None))


def _dir_scaling(config: Any, name: str, rank: int) -> float:
    """The scaling peft gives module `name` of an adapter directory: lora_alpha / r (/ sqrt(r) with use_rslora),
    rank_pattern and alpha_pattern applied as peft applies them.

    Raises:
        FieldError: a rank or lora_alpha that is not a number (named), or a rank other than the tensors' (peft
            cannot load such a directory either).
    """
    r_field, r = _dir_setting(config, "r", "rank_pattern", name)
    alpha_field, alpha = _dir_setting(config, "lora_alpha", "alpha_pattern", name)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise FieldError(r_field, f"must be a positive integer, got {r!r}")
    if r != rank:
        raise FieldError(f"{name}.lora_A", f"rank {rank}, but adapter_config.json says {r_field}={r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise FieldError(alpha_field, f"must be a finite number, got {alpha!r}")
    return alpha / math.sqrt(rank) if config.use_rslora else alpha / rank


def check_served_base(model: Any, served: torch.nn.Module, adapter_name: str | None = None) -> None:
    """Refuse a live PEFT model's adapter whose init rewrote the model's base weights (PiSSA, OLoRA, ...:
    `base_rewriting_init`) for an engine whose model does not hold that rewritten base: the adapter adds to it.

    Args:
        model: a `peft.PeftModel` (or its LoRA-injected base).
        served: the engine's model.
        adapter_name: which adapter (None: the active one).
    Raises:
        FieldError: ("init_lora_weights") an adapted module whose served weight is not the PEFT model's base weight.
    """
    name = adapter_name or active_adapter_name(model)
    config = (getattr(model, "peft_config", {}) or {}).get(name)
    init = base_rewriting_init(config)
    if init is None:
        return
    for key, layer in lora_layers(model):
        if not holds_adapter(layer, name):
            continue
        target, base = module_name(key), layer.get_base_layer().weight
        try:
            module = served.get_submodule(target)
        except AttributeError:
            continue  # a module the engine does not have: loading the adapter names it
        weight = module.get_base_layer().weight if hasattr(module, "get_base_layer") else module.weight
        if weight is base:
            continue
        if weight.shape != base.shape or not torch.equal(weight, base.to(weight.device, weight.dtype)):
            raise FieldError(
                "init_lora_weights",
                f"{init!r} rewrote the PEFT model's base weights, and its adapter adds to them, but the engine's "
                f"{target} holds other weights: serve it from an engine over that model, or push it with push_weights "
                "(which sends the rewritten base)",
            )


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
