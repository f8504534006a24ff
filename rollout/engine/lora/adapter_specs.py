"""Which tensors an adapter may bring, checked from their wire names, dtypes and shapes alone (before any byte of an
update arrives): `<module>.lora_A` / `<module>.lora_B` pairs of one rank on a Linear layer of the model, within
`max_lora_rank`, and `<module>.modules_to_save.<parameter>` copies of modules trained whole (checked further by
`saved_modules.py`)."""

from __future__ import annotations

import torch

from rollout.config import FieldError
from rollout.engine.lora.adapter_weights import WIRE_SUFFIXES, saved_parameter
from rollout.engine.lora.layers import ADAPTER_DTYPES
from rollout.peft_adapters import SAVED_MARKER

# A saved module's spec: (module name, parameter name, dtype, shape).
SavedSpec = tuple[str, str, str, tuple[int, ...]]


def check_tensor_specs(
    specs: dict[str, tuple[str, tuple[int, ...]]],
    linears: dict[str, torch.nn.Linear],
    head_names: set[str],
    max_rank: int,
) -> tuple[dict[str, dict[str, int]], dict[str, SavedSpec]]:
    """Check an adapter's tensors by wire name, dtype and shape.

    Args:
        specs: wire name -> (dtype name, shape).
        linears: the model's Linear layers an adapter may target, by module name.
        head_names: the output head's module names (LoRA there is not served unmerged).
        max_rank: the highest rank accepted (`max_lora_rank`).
    Returns:
        Each LoRA module's ranks ({"lora_A": r, "lora_B": r}), and the saved modules' specs by wire name.
    Raises:
        FieldError: the culprit tensor: an unknown name or module, a wrong dtype or shape, a rank outside
            [1, max_rank], a pair with one half missing or two ranks.
    """
    ranks: dict[str, dict[str, int]] = {}
    saved: dict[str, SavedSpec] = {}
    for wire_name, (dtype, shape) in specs.items():
        if (module_and_parameter := saved_parameter(wire_name)) is not None:
            saved[wire_name] = (*module_and_parameter, dtype, shape)
            continue
        if SAVED_MARKER in wire_name:  # "<module>.modules_to_save.<child>.<p>": a module with submodules
            module = wire_name.split(SAVED_MARKER)[0]
            raise FieldError(
                wire_name,
                f"modules_to_save of {module!r}, a module with submodules, is not served unmerged (a Linear, an "
                "Embedding, or a norm over the hidden states)",
            )
        suffix = next((s for s in WIRE_SUFFIXES if wire_name.endswith(s)), None)
        if suffix is None:
            raise FieldError(
                wire_name,
                "an adapter tensor is named '<module>.lora_A', '<module>.lora_B' or '<module>.modules_to_save.<p>'",
            )
        module = _target(linears, head_names, wire_name[: -len(suffix)], wire_name)
        if dtype not in ADAPTER_DTYPES:
            raise FieldError(wire_name, f"dtype {dtype}: adapters come in {sorted(ADAPTER_DTYPES)}")
        if len(shape) != 2:
            raise FieldError(wire_name, f"shape {list(shape)}: expected 2 dimensions")
        if suffix == ".lora_A":
            rank, expected = shape[0], [shape[0], module.in_features]
        else:
            rank, expected = shape[1], [module.out_features, shape[1]]
        if list(shape) != expected:
            raise FieldError(wire_name, f"shape {list(shape)} does not fit the module: expected {expected}")
        if not 1 <= rank <= max_rank:
            raise FieldError(wire_name, f"rank {rank} is outside [1, max_lora_rank={max_rank}]")
        ranks.setdefault(wire_name[: -len(suffix)], {})[suffix[1:]] = rank
    for module, pair in ranks.items():
        if len(pair) != 2:
            missing = "lora_B" if "lora_A" in pair else "lora_A"
            raise FieldError(f"{module}.{missing}", "missing: every module brings both lora_A and lora_B")
        if pair["lora_A"] != pair["lora_B"]:
            raise FieldError(f"{module}.lora_B", f"rank {pair['lora_B']} differs from its lora_A's {pair['lora_A']}")
    return ranks, saved


def _target(linears: dict[str, torch.nn.Linear], head_names: set[str], module_name: str, field: str) -> torch.nn.Linear:
    """The Linear layer `module_name` (a LoRA pair's target), or a FieldError naming `field`."""
    module = linears.get(module_name)
    if module is not None:
        return module
    if module_name in head_names:
        raise FieldError(field, "LoRA on the output head is not served unmerged; push with adapters='merged'")
    raise FieldError(field, f"the model has no Linear layer named {module_name!r}")
