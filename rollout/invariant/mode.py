"""`batch_invariant(model)`: the model's forward, inside the block, computed bit for bit the same for a row whatever
else is in its batch and however the row is padded (prompts left-padded, completions right-padded, as TRL lays them
out), and whatever the thread count.

Inside the block:
- the model attends with "rollout_invariant" (attention.py) instead of its own implementation;
- a call given `attention_mask` and no `position_ids` numbers each row from its first unmasked token (positions.py);
- every `torch.nn.functional.linear` called on this thread (every `nn.Linear`, the output head included) runs as
  `invariant_linear` (matmul.py), through a `TorchFunctionMode`; on a GPU the same mode runs every last-axis mean
  (an RMSNorm's) and log_softmax as `invariant_mean` / `invariant_log_softmax` (reductions.py);
- an MoE model's experts run transformers' "eager" implementation (one `F.linear` per expert, which the mode
  tiles) instead of `grouped_mm`, whose result for a token depends on how many tokens its expert got.

The backward is an ordinary autograd backward of those operations (correct, not itself invariant). Gradient
checkpointing's recompute runs in the backward, where the mode is not active: each checkpointed layer's recompute
gets the mode through `torch.utils.checkpoint`'s `context_fn` (non-reentrant checkpointing; the reentrant kind is
refused by name). Run the backward inside the block: after it, the recompute would run the ordinary forward.
Leaving the block restores the model's attention implementation, its checkpointing functions, and
removes the hook and the mode, also on an error.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from rollout.invariant.attention import register_invariant_attention
from rollout.invariant.matmul import invariant_linear
from rollout.invariant.positions import add_positions_from_mask
from rollout.invariant.reductions import invariant_reduction


class InvariantLinearMode(TorchFunctionMode):
    """Runs `torch.nn.functional.linear` as `invariant_linear`, and a last-axis mean or log_softmax of a CUDA tensor
    as `invariant_mean` / `invariant_log_softmax` (reductions.py); every other function as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_calls = 0  # the F.linear calls it routed (linear_swap.ModeNeed reads it)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            self.linear_calls += 1
            return invariant_linear(*args, **kwargs)
        reduced = invariant_reduction(func, args, kwargs)
        return func(*args, **kwargs) if reduced is None else reduced


def _invariant_recompute() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`torch.utils.checkpoint`'s context_fn: nothing around the forward, the linear mode around the recompute."""
    return contextlib.nullcontext(), InvariantLinearMode()


def _checkpointing_with_the_mode(model: torch.nn.Module) -> dict[torch.nn.Module, Any]:
    """Give every checkpointed layer's checkpoint function the mode in its recompute; return the functions it had."""
    replaced = {}
    for module in model.modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if function is None or not getattr(module, "gradient_checkpointing", False):  # not checkpointing now
            continue
        keywords = getattr(function, "keywords", {}) or {}
        if keywords.get("use_reentrant", True) is not False:
            raise ValueError(
                "batch_invariant needs non-reentrant gradient checkpointing: enable it with "
                "gradient_checkpointing_kwargs={'use_reentrant': False}"
            )
        replaced[module] = function
        module._gradient_checkpointing_func = functools.partial(function, context_fn=_invariant_recompute)
    return replaced


def eager_experts(model: torch.nn.Module) -> dict[str, Any] | None:
    """Switch an MoE model's experts to transformers' "eager" implementation (one `F.linear` per expert, which the
    mode tiles); return the implementations it had (for `set_experts_implementation`), or None if nothing changed."""
    get = getattr(model, "get_experts_implementation", None)
    if not callable(get):
        return None
    previous = get()
    if all(value in (None, "eager") for value in previous.values()):
        return None
    model.set_experts_implementation("eager")
    return previous


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The module that takes `attention_mask` and `position_ids` (a causal LM's decoder; a PeftModel's too)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, torch.nn.Module) else model


@contextlib.contextmanager
def batch_invariant(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run `model`'s forwards inside the block batch-invariantly (module docstring).

    Args:
        model: a transformers causal LM whose attention goes through transformers' AttentionInterface (a PeftModel
            of one too).
    Yields:
        `model`, unchanged but for its attention implementation while the block runs.
    Raises:
        ValueError: the model has no `config` with an attention implementation to switch, or checkpoints its layers
            with reentrant gradient checkpointing.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"batch_invariant needs a transformers model with a config, got {type(model).__name__}")
    checkpointing = _checkpointing_with_the_mode(model)
    previous = config._attn_implementation
    experts = None
    try:
        experts = eager_experts(model)
        model.set_attn_implementation(register_invariant_attention())
        hook = _decoder(model).register_forward_pre_hook(add_positions_from_mask, with_kwargs=True)
        try:
            with InvariantLinearMode():
                yield model
        finally:
            hook.remove()
            model.set_attn_implementation(previous)
    finally:
        if experts is not None:
            model.set_experts_implementation(experts)
        for module, function in checkpointing.items():
            module._gradient_checkpointing_func = function
