"""`batch_invariant(model)`: the model's forward, inside the block, computed bit for bit the same for a row whatever
else is in its batch and however the row is padded (prompts left-padded, completions right-padded, as TRL lays them
out), and whatever the thread count.

Inside the block:
- the model attends with "rollout_invariant" (attention.py) instead of its own implementation;
- a call given `attention_mask` and no `position_ids` numbers each row from its first unmasked token (positions.py),
  the model's and its decoder's;
- every `nn.Linear` of the model (the output head included) computes as `invariant_linear` (matmul.py) on this
  thread, its forward swapped (swaps.py); around each forward of the model, a `TorchFunctionMode` sends any
  other `torch.nn.functional.linear` there too. The mode costs about 4 us per torch call on a CPU: it stays only
  while the model's first forward shows it is needed (`swaps.ModeNeed`). On a GPU it covers the whole block, and
  also runs every last-axis mean (an RMSNorm's) and log_softmax, the caller's on the logits included, as
  `invariant_mean` / `invariant_log_softmax` (reductions.py);
- an MoE model's experts run transformers' "eager" implementation (one `F.linear` per expert, which the mode
  tiles) instead of `grouped_mm`, whose result for a token depends on how many tokens its expert got.

The backward is an ordinary autograd backward of those operations (correct, not itself invariant). Gradient
checkpointing's recompute runs in the backward, maybe on autograd's own thread: each checkpointed layer's recompute
gets the swapped linears (and the mode while needed) through `torch.utils.checkpoint`'s `context_fn`
(non-reentrant checkpointing; the reentrant kind is refused by name). Run the backward inside the block: after it,
the recompute would attend with the model's own attention, which torch's checkpoint refuses. Leaving the block
restores the model's attention implementation, its checkpointing functions and its linears, and removes the hooks,
also on an error. The attention implementation and the hooks belong to the model, not to a thread: another thread's
forward of the same model during the block is computed invariantly too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from rollout.attention_settings import AttentionSettings
from rollout.invariant.activations import invariant_function
from rollout.invariant.attention import ATTENTION_NAME, register_invariant_attention
from rollout.invariant.cpu_check import check_cpu_products
from rollout.invariant.matmul import invariant_linear, invariant_product
from rollout.invariant.model_support import refuse_long_dynamic_rope, refuse_variant_model
from rollout.invariant.positions import add_positions_from_mask
from rollout.invariant.reductions import invariant_reduction, on_kernel_device
from rollout.invariant.swaps import ModeNeed, mode_need_of, swapped_forwards
from rollout.validation import FieldError


class InvariantLinearMode(TorchFunctionMode):
    """Runs `torch.nn.functional.linear` and a matrix product by a 2-D weight (`invariant_product`) as
    `invariant_linear`, a functional sigmoid, SiLU, GELU or softplus as activations.py's, and a last-axis mean or
    log_softmax of a CUDA tensor as `invariant_mean` / `invariant_log_softmax` (reductions.py); every other function
    as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.routed_calls = 0  # the products and activations it routed (swaps.ModeNeed reads it)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            self.routed_calls += 1
            return invariant_linear(*args, **kwargs)
        routed = invariant_function(func, args, kwargs)
        routed = invariant_product(func, args, kwargs) if routed is None else routed
        if routed is not None:
            self.routed_calls += 1
            return routed
        reduced = invariant_reduction(func, args, kwargs)
        return func(*args, **kwargs) if reduced is None else reduced


class _ModeAroundForwards:
    """Hooks around each forward of a model: `InvariantLinearMode` around it while its `ModeNeed` says the swapped
    linears alone may not do (not known yet, a linear outside an `nn.Linear`, a kernel device), learnt from the
    first forward. Reentrant and per thread."""

    def __init__(self, need: ModeNeed):
        self.need = need
        self.open = threading.local()  # `modes`: this thread's modes, one per forward running (None: not entered)

    def enter(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        mode = None if self.need.needed(module) is False else InvariantLinearMode()
        if mode is not None:
            mode.__enter__()
        self.open.__dict__.setdefault("modes", []).append(mode)

    def completed(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """The forward returned (not called when it raised): what its mode saw can be learnt from."""
        mode = self.open.modes[-1]
        if mode is not None:
            mode.completed = True

    def leave(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """After the forward, also one that raised: its mode exits; learnt from only if it completed."""
        mode = self.open.modes.pop()
        if mode is not None:
            mode.__exit__(None, None, None)
            if getattr(mode, "completed", False):
                self.need.learn(mode, module)


@contextlib.contextmanager
def _invariant_recomputation(model: torch.nn.Module, need: ModeNeed) -> Iterator[None]:
    """Around a checkpointed layer's recompute (in the backward, maybe after the block, maybe on autograd's thread):
    the swapped linears, and the mode unless the model is known not to need it."""
    with swapped_forwards(model):
        if need.needed(model) is False:
            yield
        else:
            with InvariantLinearMode():
                yield


def _invariant_recompute(
    model: torch.nn.Module, need: ModeNeed
) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`torch.utils.checkpoint`'s context_fn: nothing around the forward, the invariant linears around the
    recompute."""
    return contextlib.nullcontext(), _invariant_recomputation(model, need)


def _checkpointing_with_the_mode(model: torch.nn.Module, need: ModeNeed) -> dict[torch.nn.Module, Any]:
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
        recompute = functools.partial(_invariant_recompute, model, need)
        module._gradient_checkpointing_func = functools.partial(function, context_fn=recompute)
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


def _numbering_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose calls get positions from the mask: the decoder, and the model itself when its forward takes
    `position_ids` (Fuyu's numbers the positions itself, 0 from the first column, before calling its decoder)."""
    decoder = _decoder(model)
    if decoder is model or "position_ids" not in inspect.signature(model.forward).parameters:
        return [decoder]
    return [model, decoder]


@contextlib.contextmanager
def batch_invariant(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run `model`'s forwards inside the block batch-invariantly (module docstring).

    Args:
        model: a transformers causal LM whose attention goes through transformers' AttentionInterface (a PeftModel
            of one too).
    Yields:
        `model`, unchanged but for its attention implementation while the block runs.
    Raises:
        ValueError: the model has no `config` with an attention implementation to switch, checkpoints its layers
            with reentrant gradient checkpointing, or is of a kind the mode cannot make bit for bit (a FieldError
            naming batch_invariant: LongRoPE, GPT-2's Conv1D layers, DeepSeek's latent attention, an attention
            transformers will not switch (GPT-Neo, Bloom, MPT), a forward past a dynamic NTK RoPE's
            length).
        RowInvarianceError: (a ValueError) on a CPU whose matmuls are not row-invariant for the model's shapes with
            this process's thread count (`cpu_check.py`).
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"batch_invariant needs a transformers model with a config, got {type(model).__name__}")
    refuse_variant_model(model)
    check_cpu_products(model)  # on the CPU, once per shape and thread count
    need = mode_need_of(model)
    checkpointing = _checkpointing_with_the_mode(model, need)
    previous = AttentionSettings.of(model)
    experts = None
    try:
        experts = eager_experts(model)
        model.set_attn_implementation(register_invariant_attention())
        if config._attn_implementation != ATTENTION_NAME:  # transformers kept the model's own (it only warns)
            kept = config._attn_implementation
            previous.restore()
            raise FieldError(
                "batch_invariant",
                f"transformers would not switch {type(model).__name__}'s attention (it kept {kept!r}): its attention "
                "does not go through transformers' AttentionInterface, so the invariant attention cannot replace it",
            )
        hooks = [
            module.register_forward_pre_hook(add_positions_from_mask, with_kwargs=True)
            for module in _numbering_modules(model)
        ]
        hooks += refuse_long_dynamic_rope(model)
        # On a kernel device the mode covers the whole block, as the reductions the caller runs on the logits (a
        # log_softmax) must take the kernels too; elsewhere it surrounds the model's forwards while they need it.
        whole_block = on_kernel_device(next(model.parameters()))
        if not whole_block:
            around = _ModeAroundForwards(need)
            hooks += [
                model.register_forward_pre_hook(around.enter, with_kwargs=True),
                model.register_forward_hook(around.completed, with_kwargs=True),
                model.register_forward_hook(around.leave, with_kwargs=True, always_call=True),
            ]
        try:
            with swapped_forwards(model), InvariantLinearMode() if whole_block else contextlib.nullcontext():
                yield model
        finally:
            for hook in hooks:
                hook.remove()
            previous.restore()
    finally:
        if experts is not None:
            model.set_experts_implementation(experts)
        for module, function in checkpointing.items():
            module._gradient_checkpointing_func = function
