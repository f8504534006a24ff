"""PEFT LoRA adapters as rollout reads them, on both sides (the engine and the trainer's pushes): adapter names,
which PEFT settings can be served unmerged, and how to find a PEFT model's LoRA layers. Imports neither torch nor
peft until a function needs them."""

from __future__ import annotations

import dataclasses
import unicodedata
from typing import Any

from rollout.config import FieldError

MAX_ADAPTER_NAME = 128
# The name peft gives the base model in a mixed batch (`adapter_names=`); never an adapter's name here either.
BASE_NAME = "__base__"
# Wire names of a saved module's parameters (peft's modules_to_save) in an adapter push: "<module>.modules_to_save.<p>".
SAVED_MARKER = ".modules_to_save."
# Unicode categories no adapter name may hold (`check_adapter_name`), and how a refusal names them.
UNNAMEABLE = {
    "Cc": "control or formatting character",
    "Cf": "control or formatting character",
    "Cs": "lone surrogate",
    "Zl": "line separator",
    "Zp": "paragraph separator",
}
# PEFT settings that change the forward beyond W0 x + s B(A x) (or train more than the LoRA pair): not served
# unmerged; push such a model with adapters="merged".
UNSERVED_SETTINGS = {
    "use_dora": "DoRA",
    "lora_bias": "a trained LoRA bias",
    "trainable_token_indices": "trainable tokens",
    "target_parameters": "LoRA on bare parameters (MoE experts)",
    "alora_invocation_tokens": "activated LoRA",
    "use_qalora": "QALoRA",
    "layer_replication": "layer replication",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "use_bdlora": "BD-LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
}
# `init_lora_weights` values peft serves through a LoRA variant whose forward is plain W0 x + s B(A x) (MiCA only
# initializes A and B its own way, and freezes B): served unmerged. Any other such value is refused.
VANILLA_INIT_VARIANTS = frozenset({"mica"})
# `init_lora_weights` values with which peft rewrites the base weights as it builds the model (W - s B0 A0: PiSSA's
# "pissa" and "pissa_niter_<n>", CorDA's "corda", "olora", "loftq", "lora_ga"). Their adapters add to that rewritten
# base, not to the checkpoint's (measured: 0.64 to 1.15 nats off peft's forward when served over the original base).
BASE_REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


def check_adapter_name(name: object, field: str = "adapter") -> str:
    """An adapter name as requests and pushes may use it.

    Args:
        name: the name to check.
        field: the field to name in the error.
    Raises:
        FieldError: not a non-empty string of at most 128 characters, one with a control or invisible formatting
            character, a lone surrogate or a line or paragraph separator, or the base model's reserved name.
    """
    if not isinstance(name, str) or not name or len(name) > MAX_ADAPTER_NAME:
        raise FieldError(field, f"must be a non-empty string of at most {MAX_ADAPTER_NAME} characters, got {name!r}")
    # Names are listed (/v1/models), echoed in plain-text answers and chosen by clients: no line breaks (U+2028 and
    # U+2029 included), NULs or invisible characters (zero-width, bidirectional overrides) that make one name look
    # like another; no lone surrogate (JSON's "\ud800"), which UTF-8 cannot carry: the worker's ZeroMQ replies that
    # list the served adapters (weights_spec_reply, stats) would fail to encode, and with them every weight push.
    odd = next((char for char in name if unicodedata.category(char) in UNNAMEABLE), None)
    if odd is not None:
        raise FieldError(field, f"holds the {UNNAMEABLE[unicodedata.category(odd)]} {odd!r}: {name!r}")
    if name == BASE_NAME:
        raise FieldError(field, f"{BASE_NAME!r} is the base model: leave the adapter out (None) to use it")
    return name


def check_peft_config(config: Any) -> None:
    """Refuse, by name, a PEFT LoRA config whose forward is more than W0 x + s B(A x).

    Args:
        config: a `peft.LoraConfig` (or anything with its attributes).
    Raises:
        FieldError: the setting that cannot be served unmerged.
    """
    peft_type = str(getattr(config, "peft_type", "LORA") or "LORA")
    if peft_type.split(".")[-1].upper() != "LORA":
        raise FieldError("peft_type", f"only LoRA adapters are served, got {peft_type}")
    if getattr(config, "bias", "none") != "none":
        raise FieldError("bias", "trained biases are not served unmerged; push with adapters='merged'")
    for name, what in _unserved_settings(config).items():
        value = getattr(config, name, None)
        if value not in (None, False) and not (isinstance(value, (set, frozenset, dict, list, tuple)) and not value):
            raise FieldError(name, f"{what} is not served unmerged; push with adapters='merged'")
    init = getattr(config, "init_lora_weights", None)
    if isinstance(init, str) and init in _init_variants(config) and init not in VANILLA_INIT_VARIANTS:
        raise FieldError(
            "init_lora_weights", f"the LoRA variant {init!r} is not served unmerged; push with adapters='merged'"
        )


def base_model_mismatch(adapter_base: object, served: object) -> str | None:
    """Why an adapter directory's `base_model_name_or_path` names another model than the one served, else None.

    Names are compared by their last path component (a hub id "org/name" and a local copy
    ".../name" or the hub cache's ".../models--org--name/snapshots/<hash>" are one model), case-insensitively.
    An empty name on either side (a model built from a config, an adapter that names no base) is no mismatch: the
    tensors' shapes are checked anyway. Only a warning is given, as LoRAX does (neither peft nor vLLM checks): an
    adapter of another model of one architecture fits every shape, and is served over weights it was not trained on.

    Args:
        adapter_base: the adapter config's `base_model_name_or_path`.
        served: the served model's `name_or_path` (its config's `_name_or_path`).
    """
    if not isinstance(adapter_base, str) or not isinstance(served, str) or not adapter_base or not served:
        return None
    if _model_id(adapter_base) == _model_id(served):
        return None
    return (
        f"the adapter was trained on base_model_name_or_path={adapter_base!r}, but the served model is {served!r}: "
        "it is served over weights it was not trained on"
    )


def _model_id(name: str) -> str:
    """A model's name for `base_model_mismatch`: the last component of a path or hub id (of the hub cache's
    "models--org--name" folder, its name), lower-cased."""
    parts = [part for part in name.replace("\\", "/").split("/") if part]
    cached = next((part for part in parts if part.startswith("models--")), None)
    if cached is not None:
        return cached.split("--")[-1].lower()
    return parts[-1].lower() if parts else ""


def base_rewriting_init(config: Any) -> str | None:
    """The config's `init_lora_weights` when peft rewrote the base weights with it (`BASE_REWRITING_INITS`), else None.

    Args:
        config: a `peft.LoraConfig` (or anything with its attributes).
    """
    init = getattr(config, "init_lora_weights", None)
    if isinstance(init, str) and any(init.lower().startswith(kind) for kind in BASE_REWRITING_INITS):
        return init
    return None


def _unserved_settings(config: Any) -> dict[str, str]:
    """`UNSERVED_SETTINGS`, and every other field the installed peft marks as a LoRA variant (`is_lora_variant`
    metadata: a forward of its own), so that a variant added by a later peft is refused, never served as plain LoRA."""
    settings = dict(UNSERVED_SETTINGS)
    if dataclasses.is_dataclass(config):
        for field in dataclasses.fields(config):
            if field.metadata.get("is_lora_variant"):
                settings.setdefault(field.name, f"the LoRA variant {field.name!r}")
    return settings


def _init_variants(config: Any) -> list[str]:
    """The `init_lora_weights` values the installed peft serves with a LoRA variant of their own."""
    if not dataclasses.is_dataclass(config):
        return []
    fields = {field.name: field for field in dataclasses.fields(config)}
    init = fields.get("init_lora_weights")
    return list(init.metadata.get("lora_variants", ())) if init is not None else []


def module_name(peft_key: str) -> str:
    """The base model's module name behind a PEFT module or state-dict key prefix: peft wraps the model as
    `base_model.model.<module>`."""
    return peft_key.removeprefix("base_model.model.")


def is_peft_model(model: Any) -> bool:
    """True for a `peft.PeftModel` with at least one LoRA adapter."""
    return (
        callable(getattr(model, "get_base_model", None))
        and bool(getattr(model, "peft_config", None))
        and any(lora_layers(model))
    )


def lora_layers(model: Any) -> Any:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return iter(())
    return ((name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer))


def adapter_submodules(model: Any) -> set[int]:
    """The ids of the modules peft added for its adapters (a LoRA layer's `lora_A`, `lora_B`, dropout, ...; the copies
    `modules_to_save` trains): not the base model's layers, whose shapes bound what an adapter may take.

    Args:
        model: a model, peft-injected or not (then the set is empty).
    """
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return set()
    added: set[int] = set()
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            children = [child for name, child in module.named_children() if name != "base_layer"]
        elif isinstance(module, ModulesToSaveWrapper):
            children = [child for name, child in module.named_children() if name != "original_module"]
        else:
            continue
        for child in children:
            added.update(id(submodule) for submodule in child.modules())
    return added


def holds_adapter(layer: Any, name: str) -> bool:
    """Whether a peft `LoraLayer` holds adapter `name`: as `lora_A` (Linear and convolution layers) or, on an
    embedding, as `lora_embedding_A` (one not looked for there would be left out of a push silently).

    Args:
        layer: a `peft.tuners.lora.LoraLayer`.
        name: the adapter.
    """
    return name in layer.lora_A or name in getattr(layer, "lora_embedding_A", {})


def active_adapter_name(model: Any) -> str:
    """The adapter a PEFT model trains (its single active adapter).

    Raises:
        FieldError: ("adapter_name") several adapters are active.
    """
    active = getattr(model, "active_adapters", None) or [getattr(model, "active_adapter", "default")]
    if len(active) != 1:
        raise FieldError("adapter_name", f"the model has {len(active)} active adapters {active}: name the one to use")
    return active[0]


def saved_modules(model: Any, adapter_name: str) -> Any:
    """(PEFT module name, the adapter's own copy) of every module the adapter trains whole (`modules_to_save`)."""
    try:
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return iter(())
    return (
        (name, module.modules_to_save[adapter_name])
        for name, module in model.named_modules()
        if isinstance(module, ModulesToSaveWrapper) and adapter_name in module.modules_to_save
    )


def hidden_width(model: Any) -> int | None:
    """The width of a model's hidden states, read from its input embeddings (through a peft wrapper of them); None
    for a model without any."""
    getter = getattr(model, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    embeddings = getattr(embeddings, "original_module", embeddings)
    weight = getattr(embeddings, "weight", None)
    return None if weight is None or weight.dim() != 2 else int(weight.shape[-1])


def saved_module_refusal(module: Any, hidden: int | None) -> str | None:
    """Why a module trained whole (`modules_to_save`) cannot be served unmerged; None when it can.

    Served: a Linear, an Embedding, or a leaf module whose parameters are all vectors of the hidden width (the norms
    over the hidden states: RMSNorm, LayerNorm). Their output has the step's tokens as rows, which is how a saved
    copy's rows are picked per adapter. A norm inside the attention heads (q_norm, of the head width) sees
    tokens x heads rows, and is not served.

    Args:
        module: the base module (or the adapter's copy of it).
        hidden: the model's hidden width (`hidden_width`).
    """
    import torch

    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        return None
    parameters = list(module.parameters())
    widths = {tuple(p.shape) for p in parameters}
    if parameters and hidden is not None and widths == {(hidden,)} and not list(module.children()):
        return None
    return (
        f"modules_to_save of a {type(module).__name__} is not served unmerged (a Linear, an Embedding, or a norm "
        "over the hidden states)"
    )
