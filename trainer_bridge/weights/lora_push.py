"""Adapter-only pushes of a PEFT LoRA model: what travels is the active adapter's lora_A / lora_B tensors (wire names
"<module>.lora_A" / "<module>.lora_B", in the adapter's own dtype) and their scalings, and the trained copies of its
modules_to_save ("<module>.modules_to_save.<parameter>", the output head's included); the workers serve them
unmerged over the base they hold (`adapter_mode.py` says which adapters they can serve so). The frozen base travels
once: in the same transaction as the adapter, to every worker of the push, whenever a worker does not hold this
trainer's base yet (its first push, or a worker that restarted). The base is named by a `base_id`: one per base model
object in this process and per contents (a base changed in place travels again)."""

from __future__ import annotations

import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from rollout.peft_adapters import SAVED_MARKER, active_adapter_name, holds_adapter, module_name, saved_modules
from trainer_bridge.gathering import Entry, full_copy, peft_entries, shape_of
from trainer_bridge.weights.adapter_mode import check_servable, push_mode

_BASE_IDS: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
FINGERPRINT_ROW = 1024  # a 1-D tensor's (a ZeRO-3 shard's) elements per row of the base fingerprint


@dataclass
class AdapterPush:
    """The adapter side of one push: its name on the workers, its tensors and scalings, and the base it needs."""

    name: str
    entries: list[Entry]
    scalings: dict[str, float]
    base_id: str | None  # None: an unnamed base (a peer copy of one)
    base_entries: list[Entry] = field(default_factory=list)  # the frozen base, sent only where it is missing
    accelerator: Any = None  # a multi-process trainer's: every rank must gather what the main process sends
    always_base: bool = False  # send the base whatever the workers say they hold (a peer copy of an unnamed base)
    base_included: bool | None = None  # decided once per push (`choose`)

    def choose(self, include_base: bool) -> list[Entry]:
        """Decide, once per push, whether the base travels, and return what is sent, in order. In a multi-process
        trainer the main process's decision reaches every rank (each then gathers the same tensors); the other
        ranks call this with anything (their value is ignored)."""
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            include_base = bool(broadcast_object_list([include_base], from_process=0)[0])
        self.base_included = include_base or self.always_base
        return (self.base_entries if self.base_included else []) + self.entries

    def refused_for_rank(self, error: Exception) -> bool:
        """Whether `error` is the workers refusing one of this adapter's tensors for its rank (above their
        `max_lora_rank`, which they name): the one refusal "auto" answers by pushing merged weights instead.

        Args:
            error: what the push raised.
        """
        names = {entry.name for entry in self.entries}
        field = getattr(error, "field", None)
        return getattr(error, "code", None) == "bad_update" and field in names and "max_lora_rank" in str(error)

    @property
    def num_bytes(self) -> int:
        """Bytes of the adapter's tensors."""
        return sum(torch.Size(entry.shape).numel() * entry.dtype.itemsize for entry in self.entries)


def base_id_of(model: Any) -> str:
    """The id of a PEFT model's base weights in this process: one per base model object and per contents, so that
    a base changed in place is a new base, which travels again (ReLoRA's `merge_and_unload()` then a new adapter
    over the same model, or any in-place edit of its weights). Were it named by the object alone, the workers would
    serve the new adapter over the old base, with no error.

    Args:
        model: an unwrapped `peft.PeftModel`.
    """
    base = model.get_base_model()
    if base not in _BASE_IDS:
        _BASE_IDS[base] = uuid.uuid4().hex
    return f"{_BASE_IDS[base]}-{_base_contents(base)}"


@torch.no_grad()
def _base_contents(base: torch.nn.Module) -> str:
    """A fingerprint of the base weights this process holds (its shard, under ZeRO-3 or FSDP2): each tensor's row
    sums (a 1-D tensor's, of rows of `FINGERPRINT_ROW` elements), accumulated in fp32 without a copy, then their
    total and their total weighted by the row's place, both in fp64 (exact places, and a swap of two rows moves the
    weighted total by their sums' difference, above its rounding), which any merge or scaling moves, and a swap of
    rows too (one read of the weights: a few ms on a GPU). The adapters' own tensors (lora_*, modules_to_save
    copies), trained every step, are left out."""
    sums: dict[torch.device, list[torch.Tensor]] = {}  # per device: a model placed on several (a device_map)
    for name, param in base.named_parameters():
        if "lora_" in name or SAVED_MARKER in name:
            continue
        local = param.to_local() if hasattr(param, "to_local") else getattr(param, "ds_tensor", param)
        if local.numel():
            rows = _row_sums(local.detach()).double()
            places = torch.arange(1, rows.numel() + 1, device=rows.device, dtype=torch.float64)
            sums.setdefault(local.device, []).extend((rows.sum(), torch.dot(rows, places)))
    digest = xxhash.xxh3_64()
    for each in sums.values():  # (one device-to-host copy per device)
        digest.update(torch.stack(each).cpu().numpy().tobytes())
    return digest.hexdigest()


def _row_sums(weights: torch.Tensor) -> torch.Tensor:
    """The fp32 sums of a tensor's rows (its last dimension), or of a 1-D tensor's runs of `FINGERPRINT_ROW` elements
    and its tail: no copy of the tensor (a ZeRO-3 shard is 1-D and may be hundreds of MB)."""
    if weights.dim() > 1:
        return weights.sum(dim=-1, dtype=torch.float32).flatten()
    whole = weights.numel() // FINGERPRINT_ROW * FINGERPRINT_ROW
    head = weights[:whole].view(-1, FINGERPRINT_ROW).sum(dim=-1, dtype=torch.float32)
    return torch.cat((head, weights[whole:].float()))


def adapter_push(
    model: Any, adapter_name: str | None = None, served_name: str | None = None, accelerator: Any = None
) -> AdapterPush:
    """What an adapter-only push of `model` sends.

    Args:
        model: an unwrapped `peft.PeftModel` with LoRA adapters.
        adapter_name: which of its adapters (None: the active one).
        served_name: the name the workers serve it under (None: the adapter's own name).
        accelerator: the `accelerate.Accelerator` of a multi-process trainer (every rank calls this).
    Raises:
        ValueError: (FieldError) an adapter that cannot be served unmerged (DoRA, a LoRA bias, a non-Linear
            target, ...: `adapter_mode.check_servable`), named; such a model is pushed merged.
    """
    from peft.tuners.lora import LoraLayer

    name = adapter_name or active_adapter_name(model)
    check_servable(model, name)
    entries, scalings = [], {}
    for key, layer in model.named_modules():
        if not isinstance(layer, LoraLayer) or not holds_adapter(layer, name):
            continue
        target = module_name(key)
        for part in ("lora_A", "lora_B"):
            weight = getattr(layer, part)[name].weight
            entries.append(Entry(f"{target}.{part}", weight.dtype, shape_of(weight), lambda w=weight: full_copy(w)))
        scalings[target] = float(layer.scaling[name])
    # modules_to_save: the adapter's trained copies, whole (a copy tied to another, peft's ensure_weight_tying,
    # travels under each module's name: the workers serve each module's copy).
    for key, copy in saved_modules(model, name):
        for part, param in copy.named_parameters():
            wire = f"{module_name(key)}{SAVED_MARKER}{part}"
            entries.append(Entry(wire, param.dtype, shape_of(param), lambda p=param: full_copy(p)))
    base = peft_entries(model, merged=False)
    return AdapterPush(served_name or name, entries, scalings, base_id_of(model), base, accelerator)


def served_adapter_name(
    source: Any, accelerator: Any = None, adapters: str = "auto", adapter_name: str | None = None
) -> str | None:
    """The adapter name `push_weights(client, source, adapters=..., adapter_name=...)` serves (None when it pushes
    whole or merged weights): what every rank's client samples with (`RolloutClient.adapter`), the main process's
    included."""
    from trainer_bridge.gathering import unwrapped

    if push_mode(source, adapters, accelerator, warn=False) != "adapter":
        return None
    return adapter_name or active_adapter_name(unwrapped(source, accelerator))
