"""Which LoRA adapter a request is served with, as the torch-free parts of the engine (requests, block manager,
outputs) see it. The adapter's weights live in `lora.AdapterTable`, which owns these references."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.peft_adapters import BASE_NAME, check_adapter_name
from rollout.validation import FieldError

__all__ = ["BASE_NAME", "AdapterRef", "AdapterUnloaded", "check_adapter_name"]


class AdapterUnloaded(FieldError):
    """("adapter") A request's adapter stopped being served between the request's intake and its submission to the
    engine (an unload, or an unload and a load of the same name, in between): it never runs, and ends with
    finish_reason "abort", as the unload's other requests do."""


@dataclass(eq=False, slots=True)
class AdapterRef:
    """One served adapter. The table updates `version` in place when the adapter is replaced, so requests and
    outputs always read the version serving now; `slot` never changes while the adapter is served.

    Attributes:
        name: the adapter's name (requests choose it by name).
        slot: its row in the stacked LoRA weights.
        version: the policy version its weights arrived with (0: loaded at start).
    """

    name: str
    slot: int
    version: int
