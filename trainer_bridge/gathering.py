"""What a weight push sends: the tensors of a model, one whole tensor at a time, from a plain module, an
accelerate-prepared one (DDP, torch.compile wrappers), DeepSpeed ZeRO-3 (gathered one parameter at a time), FSDP2
DTensors (`full_tensor()` one at a time) or a PEFT model (LoRA merged into the base weights under the base names,
the model left unmodified). `weight_sync.py` decides how to send them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rollout.sharded_params import is_dtensor, is_zero3


@dataclass
class Entry:
    """One tensor to send: its name, dtype and full shape, and how to get its whole value."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    fetch: Callable[[], torch.Tensor]  # gathers if needed: every rank must call it, in the same order


@contextlib.contextmanager
def gathered(params: list[torch.Tensor]) -> Iterator[None]:
    """Make ZeRO-3-partitioned `params` whole for the duration (a collective: every rank enters it)."""
    partitioned = [param for param in params if is_zero3(param)]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def full_copy(param: torch.Tensor) -> torch.Tensor:
    """A whole, detached copy of one parameter or buffer (gathered if sharded)."""
    if is_dtensor(param):
        return param.full_tensor().detach()
    if is_zero3(param):
        with gathered([param]):
            return param.data.detach().clone()
    return param.detach()


def shape_of(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(param.ds_shape) if is_zero3(param) else tuple(param.shape)


def unwrapped(model: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    while type(model).__name__ in ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine") and hasattr(
        model, "module"
    ):
        model = model.module
    return getattr(model, "_orig_mod", model)  # torch.compile wrapper


def _module_entries(model: torch.nn.Module) -> list[Entry]:
    entries = [
        Entry(name, param.dtype, shape_of(param), lambda param=param: full_copy(param))
        for name, param in model.named_parameters()
    ]
    return entries + _buffer_entries(model)


def _buffer_entries(model: torch.nn.Module, rename: Callable[[str], str | None] = lambda name: name) -> list[Entry]:
    """Persistent buffers (they are in the state_dict); `rename` maps a name, or drops it by returning None."""
    entries = []
    for module_name, module in model.named_modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer is None or buffer_name in module._non_persistent_buffers_set:
                continue
            name = rename(f"{module_name}.{buffer_name}" if module_name else buffer_name)
            if name is not None:
                entries.append(Entry(name, buffer.dtype, tuple(buffer.shape), lambda b=buffer: full_copy(b)))
    return entries


def merge_refusal(model: torch.nn.Module) -> str | None:
    """Why a PEFT model's weights cannot be merged on the fly (None: they can): an adapter other than LoRA (or
    LoRA's trainable tokens, `trainable_token_indices`), or a trained LoRA bias on a layer without a bias."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in model.get_base_model().named_modules():
        if isinstance(module, BaseTunerLayer) and not isinstance(module, (LoraLayer, *_token_layer_types())):
            return (
                f"{name}: only LoRA adapters can be merged on the fly; merge_and_unload() the model into a plain one "
                "to sync it"
            )
        if isinstance(module, LoraLayer) and any(module.lora_bias.get(a) for a in module.active_adapters):
            if getattr(module.get_base_layer(), "bias", None) is None:
                return f"{name}: a LoRA bias on a layer without a bias cannot be merged into the base model"
    return None


def peft_entries(model: torch.nn.Module, merged: bool = True) -> list[Entry]:
    """Merged weights of a PEFT LoRA model under the base model's names: each layer's weight merged as peft merges
    it (W + the active adapters' deltas; DoRA through peft's own merge), LoRA biases added to the base bias, LoRA on
    bare parameters (peft's `target_parameters`, e.g. MoE experts' stacked weights, wrapped once per parameter)
    added to each parameter it adapts, computed per tensor (the model is not modified), with no LoRA tensors; with
    merged=False the base weights alone (an adapter-only push's base).

    Raises:
        NotImplementedError: `merge_refusal`'s reason.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model()
    prefix = getattr(model, "prefix", None) or getattr(model.base_model, "prefix", "lora_")
    modules = dict(base.named_modules())
    tuners = {key for key, module in modules.items() if isinstance(module, BaseTunerLayer)}
    # trainable tokens (`trainable_token_indices`): `<embedding>.token_adapter.base_layer.weight` is the embedding's
    tokens = {key for key, module in modules.items() if isinstance(module, _token_layer_types())}
    refusal = merge_refusal(model)
    if refusal is not None:
        raise NotImplementedError(refusal)

    def base_name(name: str) -> str | None:
        """The base model's name of a PEFT model's tensor; None for adapter tensors and frozen originals."""
        parts = name.split(".")
        if any(part.startswith(prefix) or part in TOKEN_ADAPTER_TENSORS for part in parts):
            return None  # adapter tensors
        if "original_module" in parts:  # the frozen original of a modules_to_save module
            wrapper = modules[".".join(parts[: parts.index("original_module")])]
            if merged and _active_copy(wrapper) is not None:
                return None  # merged: the active adapter's trained copy instead
            parts = [part for part in parts if part != "original_module"]
        elif "modules_to_save" in parts and not merged:
            return None  # the base alone: not the trained copies
        if "modules_to_save" in parts:
            at = parts.index("modules_to_save")
            if parts[at + 1] != _active_copy(modules[".".join(parts[:at])]):
                return None
            parts = parts[:at] + parts[at + 2 :]
        # Every wrapper's `base_layer`: peft wraps a LoRA target as `<module>.base_layer`, and LoRA on bare
        # parameters wraps once per parameter, the wrapper of one parameter around the other's
        # (`experts.base_layer.base_layer.down_proj`). A tuner never lies inside a modules_to_save wrapper (peft
        # refuses that), so the paths looked up here are the original ones.
        return ".".join(
            part
            for at, part in enumerate(parts)
            if not (part == "base_layer" and ".".join(parts[:at]) in tuners)
            and not (part == "token_adapter" and ".".join(parts[: at + 1]) in tokens)
        )

    entries = []
    for name, param in base.named_parameters():
        clean = base_name(name)
        if clean is None:
            continue
        weight_of, bias_of = _lora_layers_of(name, param, modules, tuners) if merged else ([], [])
        owner = name.rsplit(".base_layer.", 1)[0]  # (the trainable tokens' layer of an embedding's weight)
        token_layer = modules[owner] if merged and owner in tokens else None
        if token_layer is not None and token_layer.get_base_layer().weight is param:
            entries.append(
                Entry(clean, param.dtype, shape_of(param), lambda t=token_layer, w=param: _with_tokens(t, w))
            )
        elif weight_of:
            entries.append(Entry(clean, param.dtype, shape_of(param), lambda lr=weight_of, w=param: _merged(lr, w)))
        elif bias_of:
            entries.append(Entry(clean, param.dtype, shape_of(param), lambda lr=bias_of, b=param: _merged_bias(lr, b)))
        else:
            entries.append(Entry(clean, param.dtype, shape_of(param), lambda param=param: full_copy(param)))
    return entries + _buffer_entries(base, base_name)


# The tensors of LoRA's trainable tokens (peft's TrainableTokensLayer): the trained rows and their originals.
TOKEN_ADAPTER_TENSORS = ("trainable_tokens_delta", "trainable_tokens_original")


def _token_layer_types() -> tuple[type, ...]:
    """peft's TrainableTokensLayer (none with a peft that has no trainable tokens)."""
    try:
        from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
    except ImportError:
        return ()
    return (TrainableTokensLayer,)


def _with_tokens(layer: Any, weight: torch.Tensor) -> torch.Tensor:
    """An embedding (or a head tied to it) with its active adapters' trainable token rows in place, as peft's
    `get_merged_weights` computes it, on a copy (the model is not modified)."""
    with gathered([weight, *layer.parameters()]), torch.no_grad():
        merged = weight.detach().clone()
        for adapter in (a for a in layer.active_adapters if a in layer.token_indices):
            index = torch.tensor(layer.token_indices[adapter], device=merged.device)
            merged.index_copy_(0, index, layer.trainable_tokens_delta[adapter].to(merged))
        return merged.full_tensor() if is_dtensor(merged) else merged


def _lora_layers_of(
    name: str, param: torch.Tensor, modules: dict[str, torch.nn.Module], tuners: set[str]
) -> tuple[list[Any], list[Any]]:
    """The LoRA layers that adapt a base parameter, outermost first: (those whose delta its value gains, those whose
    LoRA bias it gains). A layer's delta goes to its base layer's `weight`, or with LoRA on a bare parameter (a
    `ParamWrapper`) to that parameter of the innermost base module; the wrappers of one module's other parameters
    leave this one alone."""
    from peft.tuners.lora import LoraLayer

    parts = name.split(".")
    wrappers = [".".join(parts[:at]) for at, part in enumerate(parts) if part == "base_layer"]
    weight_of, bias_of = [], []
    for layer in (modules[key] for key in wrappers if key in tuners):
        if not isinstance(layer, LoraLayer):
            continue
        inner = layer.get_base_layer()
        target = getattr(layer, "parameter_name", None)  # a ParamWrapper's parameter (peft's target_parameters)
        if (getattr(inner, target, None) if target is not None else getattr(inner, "weight", None)) is param:
            weight_of.append(layer)
        elif target is None and getattr(inner, "bias", None) is param:
            bias_of.append(layer)
    return weight_of, bias_of


def _active_copy(wrapper: Any) -> str | None:
    """The adapter whose copy a peft ModulesToSaveWrapper uses now (None: it uses the original; peft sets an empty
    list when the active adapter saves no copy of this module)."""
    active = wrapper.active_adapter
    if isinstance(active, (list, tuple)):
        active = active[0] if active else None
    return active if active in wrapper.modules_to_save else None


def _unmerged_adapters(layer: Any) -> list[str]:
    """The active adapters of a LoRA layer that are not merged into its base weight yet."""
    known = {*getattr(layer, "lora_A", {}), *getattr(layer, "lora_embedding_A", {})}
    return [adapter for adapter in layer.active_adapters if adapter in known and adapter not in layer.merged_adapters]


def _merged(layers: list[Any], weight: torch.Tensor) -> torch.Tensor:
    """Base weight + the LoRA deltas of the active, not yet merged adapters of the layers that adapt it (outermost
    first; peft's own `get_delta_weight`, also a ParamWrapper's over stacked experts); a LoRA variant (DoRA) merged
    by peft's own `merge_safe`, on a copy."""
    with gathered(list(layers[0].parameters())), torch.no_grad():  # the outermost holds the others and the weight
        merged = weight.detach().clone()
        for layer in layers:
            for adapter in _unmerged_adapters(layer):
                variant = getattr(layer, "lora_variant", {}).get(adapter)
                if variant is None:
                    merged += layer.get_delta_weight(adapter).to(merged.dtype)
                else:
                    merged = variant.merge_safe(layer, adapter, merged)
                    # DoRA's merge keeps the weight norm for an unmerge that never comes: the model is left as it was.
                    getattr(layer, "_caches", {}).pop(f"{adapter}-weight_norm", None)
        return merged.full_tensor() if is_dtensor(merged) else merged  # FSDP2: the whole tensor, not a shard


def _merged_bias(layers: list[Any], bias: torch.Tensor) -> torch.Tensor:
    """Base bias + scaling x lora_B's bias of the active, not yet merged adapters that train one (peft's merge)."""
    with gathered(list(layers[0].parameters())), torch.no_grad():
        merged = bias.detach().clone()
        for layer in layers:
            for adapter in _unmerged_adapters(layer):
                if layer.lora_bias.get(adapter):
                    merged += (layer.lora_B[adapter].bias * layer.scaling[adapter]).to(merged.dtype)
        return merged.full_tensor() if is_dtensor(merged) else merged


def entries_of(source: Any, accelerator: Any) -> list[Entry]:
    """What `push_weights` sends of `source` (see `weight_specs`), in order, nothing gathered yet."""
    if isinstance(source, torch.nn.Module):
        model = unwrapped(source, accelerator)
        if any(type(module).__name__ == "FullyShardedDataParallel" for module in model.modules()):
            raise NotImplementedError(
                "FSDP1 (FullyShardedDataParallel) flat parameters are not supported; shard with FSDP2 (fully_shard, "
                "accelerate's fsdp_version=2), whose parameters are gathered one at a time"
            )
        if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
            return peft_entries(model)
        return _module_entries(model)
    expected = "expected an nn.Module, a dict of name -> torch.Tensor, or an iterable of (name, tensor) pairs"
    if isinstance(source, (str, bytes)) or not isinstance(source, (Mapping, Iterable)):
        raise TypeError(f"{expected}, got {type(source).__name__}")
    entries = []
    for item in source.items() if isinstance(source, Mapping) else source:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"{expected}; got an item {type(item).__name__} {item!r:.60}")
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{expected}; got ({type(name).__name__}, {type(tensor).__name__})")
        entries.append(Entry(name, tensor.dtype, tuple(tensor.shape), lambda t=tensor: full_copy(t)))
    return entries


def weight_specs(model_or_named_tensors: Any, accelerator: Any = None) -> dict[str, tuple[torch.dtype, tuple]]:
    """Name -> (dtype, full shape) of what `push_weights` would send, without gathering anything.

    Args:
        model_or_named_tensors: an nn.Module (plain, accelerate-prepared, ZeRO-3, FSDP2 or PEFT), or a dict /
            iterable of (name, tensor).
        accelerator: the `accelerate.Accelerator` that prepared the model, if any.
    """
    return {entry.name: (entry.dtype, entry.shape) for entry in entries_of(model_or_named_tensors, accelerator)}


def iter_weights(model_or_named_tensors: Any, accelerator: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, whole tensor) one at a time, gathering sharded parameters as it goes. In a multi-process run
    every rank must iterate it to the end (the gathers are collectives).

    Args:
        model_or_named_tensors: as for `weight_specs`.
        accelerator: as for `weight_specs`.
    """
    for entry in entries_of(model_or_named_tensors, accelerator):
        yield entry.name, entry.fetch()


def as_wire_bytes(tensor: torch.Tensor, dtype: torch.dtype, keep_device: bool) -> torch.Tensor:
    """The tensor in the wire dtype as a flat uint8 tensor (on the CPU unless `keep_device`)."""
    tensor = tensor.detach()
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if not keep_device:
        tensor = tensor.cpu()
    return tensor.contiguous().reshape(-1).view(torch.uint8)
