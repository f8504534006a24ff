"""Which LoRA adapter a request is served with, as the torch-free parts of the engine (requests, block manager,
outputs) see it. The adapter's weights live in `lora.AdapterTable`, which owns these references."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.config import FieldError

MAX_ADAPTER_NAME = 128
# The name peft gives the base model in a mixed batch (`adapter_names=`); never an adapter's name here either.
BASE_NAME = "__base__"


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


def check_adapter_name(name: object, field: str = "adapter") -> str:
    """An adapter name as requests and pushes may use it.

    Args:
        name: the name to check.
        field: the field to name in the error.
    Raises:
        FieldError: not a non-empty string of at most 128 characters, or the base model's reserved name.
    """
    if not isinstance(name, str) or not name or len(name) > MAX_ADAPTER_NAME:
        raise FieldError(field, f"must be a non-empty string of at most {MAX_ADAPTER_NAME} characters, got {name!r}")
    if name == BASE_NAME:
        raise FieldError(field, f"{BASE_NAME!r} is the base model: leave the adapter out (None) to use it")
    return name
