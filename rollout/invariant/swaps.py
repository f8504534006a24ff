"""The cheap half of the batch-invariant mode: a model's `nn.Linear` modules computing as `invariant_linear`, and
its activation modules as the position-invariant functions of activations.py, on the threads that ask for it,
without a `TorchFunctionMode`.

`InvariantLinearMode` (mode.py) sees every torch call of a forward, at about 4 us each on a CPU: on a tiny model that
was a third of an invariant engine's time. A swapped `forward` costs one thread-local read per module instead. What
a swap cannot see still needs the mode: an `F.linear` called outside an `nn.Linear` (an MoE model's eager experts, a
custom layer), a functional sigmoid or SiLU (Qwen2-MoE's shared-expert gate, sigmoid routers) and, on a GPU, the
last-axis means and log_softmax that the mode sends to Triton kernels. `ModeNeed` finds out which a model needs from
its first forward, run under the mode, which counts the calls it routes: with every `nn.Linear` and activation module
swapped, any it sees came from elsewhere.

A swap is an entry `forward` in the instance dictionary of each plain `nn.Linear` (one whose class's forward is
torch's own) and each activation module activations.py knows, put there while at least one forward on any thread runs
with `swapped_forwards`, and removed when the last one ends: nothing is left on the model. Behind accelerate's hooks
(`device_map`, offloading: an instance `forward` that runs the hook around the module's `_old_forward`) the swap
takes the place of `_old_forward`, and gives the hook's back when the last forward ends; it never replaces any
other instance `forward` of someone else's. A thread that did not ask gets the module's own forward from the swap.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator

import torch

from rollout.invariant.activations import invariant_activation
from rollout.invariant.matmul import invariant_linear
from rollout.invariant.reductions import on_kernel_device

_THREAD = threading.local()  # `active`: this thread's swapped modules run invariantly


def _swapped_linear(module: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
    if getattr(_THREAD, "active", False):
        return invariant_linear(input, module.weight, module.bias)
    return torch.nn.Linear.forward(module, input)


def _swapped_activation(
    module: torch.nn.Module,
    function: Callable[[torch.Tensor], torch.Tensor],
    input: torch.Tensor,  # noqa: A002 - the activations' own name
) -> torch.Tensor:
    if getattr(_THREAD, "active", False):
        return function(input)
    return type(module).forward(module, input)


def _swap_slot(module: torch.nn.Module) -> str | None:
    """The instance attribute a swap of `module` takes: "forward"; "_old_forward" behind accelerate's hook, when the
    hook calls the module's own class forward; None behind any other instance forward (someone else's)."""
    if "forward" not in module.__dict__:
        return "forward"
    hooked = module.__dict__.get("_old_forward")
    if "_hf_hook" in module.__dict__ and getattr(hooked, "__self__", None) is module:
        if getattr(hooked, "__func__", None) is type(module).forward:
            return "_old_forward"
    return None


def _swapped(module: torch.nn.Module) -> functools.partial | None:
    """The forward to swap in for `module` (None: it keeps its own)."""
    if type(module).forward is torch.nn.Linear.forward:
        return functools.partial(_swapped_linear, module)
    function = invariant_activation(module)
    return None if function is None else functools.partial(_swapped_activation, module, function)


class _Swap:
    """One model's swapped modules and how many forwards hold the swap."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        # module -> (the attribute swapped, the swap, what the attribute held before: None when absent)
        self.swaps: dict[torch.nn.Module, tuple[str, functools.partial, object]] = {}
        # The modules' foreign forwards as the first holder found them (`foreign_forwards`), while any holds it.
        self.foreign: frozenset[int] | None = None

    def hold(self, model: torch.nn.Module) -> None:
        with self.lock:
            if self.holders == 0:  # the model's modules as they are now (a module may have been replaced since)
                foreign = []
                for module in model.modules():
                    if _foreign(found := module.__dict__.get("forward")):  # before this swap's, as the walk
                        foreign.append(id(found))  # of `foreign_forwards` finds them (another model's swap's: not)
                    slot, forward = _swap_slot(module), _swapped(module)
                    if slot is not None and forward is not None:
                        self.swaps[module] = (slot, forward, module.__dict__.get(slot))
                        module.__dict__[slot] = forward
                self.foreign = frozenset(foreign)
            self.holders += 1

    def let_go(self) -> None:
        with self.lock:
            self.holders -= 1
            if self.holders == 0:
                self.foreign = None
                for module, (slot, forward, before) in self.swaps.items():
                    if module.__dict__.get(slot) is not forward:  # replaced since by someone else: theirs stays
                        continue
                    if before is None:
                        del module.__dict__[slot]
                    else:
                        module.__dict__[slot] = before
                self.swaps = {}


_SWAPS: weakref.WeakKeyDictionary[torch.nn.Module, _Swap] = weakref.WeakKeyDictionary()
_SWAPS_LOCK = threading.Lock()


@contextlib.contextmanager
def swapped_forwards(model: torch.nn.Module) -> Iterator[None]:
    """Run `model`'s plain `nn.Linear` modules as `invariant_linear`, and its known activation modules as
    activations.py's functions, on this thread inside the block (module docstring). Reentrant, and safe beside
    other threads using the model (they see the modules' own forwards).

    Args:
        model: the model whose modules to swap.
    """
    with _SWAPS_LOCK:
        swap = _SWAPS.get(model)
        if swap is None:
            swap = _SWAPS[model] = _Swap()
    previous = getattr(_THREAD, "active", False)
    swap.hold(model)
    _THREAD.active = True
    try:
        yield
    finally:
        _THREAD.active = previous
        swap.let_go()


def foreign_forwards(model: torch.nn.Module) -> frozenset[int]:
    """The instance `forward`s of `model`'s modules that are not a swap's (someone else's: TRL's fp32 head under
    `cast_lm_head_to_fp32` is a function calling `F.linear`, accelerate's hooks), by identity. One set after a
    model's need was learnt may call what no swap sees, so the need is learnt again for it (`ModeNeed`). While the
    model's forwards are swapped, the set its swap found when it began (one walk of the modules per swap, not per
    call: 0.5 ms for a model of 550 modules); a forward set inside a `batch_invariant` block is seen at the next."""
    swap = _SWAPS.get(model)
    held = None if swap is None else swap.foreign
    if held is not None:
        return held
    return frozenset(id(forward) for module in model.modules() if _foreign(forward := module.__dict__.get("forward")))


def _foreign(forward: object) -> bool:
    """Whether a module's instance `forward` (None: it has none) is someone else's: not a swap's, of any model's (a
    model holding another swapped model's modules, e.g. a wrapper, sees that model's swaps)."""
    return forward is not None and not (
        isinstance(forward, functools.partial) and forward.func in (_swapped_linear, _swapped_activation)
    )


class ModeNeed:
    """Whether a model's forwards still need `InvariantLinearMode` beside `swapped_forwards`, per device type and dtype
    of its parameters and per set of its modules' foreign forwards (`foreign_forwards`): unknown until a forward
    there completed under the mode; then yes on a kernel device (its reductions) or when the mode routed any
    `F.linear`, sigmoid or SiLU call."""

    def __init__(self) -> None:
        self._learnt: dict[tuple[str, torch.dtype, frozenset[int]], bool] = {}

    def needed(self, model: torch.nn.Module) -> bool | None:
        """Whether the mode is needed for `model`'s forwards as its modules are now (None: not known yet)."""
        return self._learnt.get(_need_key(model))

    def learn(self, mode: torch.overrides.TorchFunctionMode, model: torch.nn.Module) -> None:
        """Record what one completed forward of `model` under `mode` (an `InvariantLinearMode`) showed.

        Args:
            mode: the mode the forward ran under (its `routed_calls` counted).
            model: the model (its parameters' device and dtype, its modules' foreign forwards).
        """
        sample = next(model.parameters())
        self._learnt.setdefault(_need_key(model), on_kernel_device(sample) or mode.routed_calls > 0)


def _need_key(model: torch.nn.Module) -> tuple[str, torch.dtype, frozenset[int]]:
    sample = next(model.parameters())
    return sample.device.type, sample.dtype, foreign_forwards(model)


_NEEDS: weakref.WeakKeyDictionary[torch.nn.Module, ModeNeed] = weakref.WeakKeyDictionary()


def mode_need_of(model: torch.nn.Module) -> ModeNeed:
    """The `ModeNeed` of `model`'s forwards, shared by every batch-invariant block over it."""
    with _SWAPS_LOCK:
        return _NEEDS.setdefault(model, ModeNeed())
