"""What of a PEFT model's base is trained beside its adapters, which an adapter push would not carry or a worker's
tied model could not hold: base parameters a user unfroze, and a trained module (LoRA-wrapped, or in a merged push a
`modules_to_save` copy) whose base weight another module shares (tied input and output embeddings).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def unfrozen_base_parameters(model: Any) -> list[str]:
    """The base model's parameters that train (`requires_grad`) beside the adapters: neither adapter tensors nor
    `modules_to_save` copies (an adapter-only push sends the base once, never these again).

    Args:
        model: a peft.PeftModel.
    """
    prefix = getattr(model, "prefix", None) or getattr(model.base_model, "prefix", "lora_")
    names = []
    for name, param in model.get_base_model().named_parameters():
        parts = name.split(".")
        if not param.requires_grad or "modules_to_save" in parts or any(part.startswith(prefix) for part in parts):
            continue
        names.append(name)
    return names


def tied_to_a_trained_module(model: Any, saved_copies: bool = True) -> str | None:
    """Why the model's weights cannot be served where a trained module's base weight is tied to another module's
    (None: none is): the trainer changes one side only, and a worker's tied model holds one tensor for both.

    A LoRA-wrapped module (its delta merged into the tied tensor) is always such a module. A `modules_to_save` one
    only in a merged push: peft trains a copy apart from the frozen tied weight, which an adapter-only push carries
    as the adapter's own, served beside the tied base as peft computes it.

    Args:
        model: a peft.PeftModel.
        saved_copies: count `modules_to_save` modules too (a merged push, or an in-place merge).
    """
    marks = (".base_layer.", ".original_module.") if saved_copies else (".base_layer.",)
    shared: dict[int, list[str]] = defaultdict(list)
    for name, param in model.get_base_model().named_parameters(remove_duplicate=False):
        shared[id(param)].append(name)
    for names in shared.values():
        # (peft ties trainable tokens' rows itself: refused as an adapter neither served unmerged nor merged)
        trained = [name for name in names if any(m in name for m in marks) and ".token_adapter." not in name]
        if len(names) > 1 and trained:
            others = [name for name in names if name not in trained] or trained[1:]  # (both sides trained)
            saved = ".original_module." in trained[0]
            return (
                f"{_module_of(trained[0])} is trained ({'modules_to_save' if saved else 'LoRA'}) but its weight is "
                f"tied to {_module_of(others[0])}: "
                + (
                    "a merged push would write the trained copy into the tensor a worker's tied model holds for "
                    "both (an adapter-only push serves it: adapters='auto' or 'adapter'). "
                    if saved
                    else "the trainer changes one of the two, a worker's tied model would change both. "
                )
                + "Untie the embeddings (tie_word_embeddings=False) before training, or leave the tied modules out "
                "of target_modules" + ("" if saved else " and modules_to_save")
            )
    return None


def _module_of(parameter: str) -> str:
    """The module a parameter of a PEFT model's base belongs to, as the user names it in `target_modules` or
    `modules_to_save` ("lm_head.original_module.weight" -> "lm_head")."""
    module = parameter.rsplit(".", 1)[0]
    for wrapped in (".original_module", ".base_layer"):
        module = module.split(wrapped)[0]
    return module
