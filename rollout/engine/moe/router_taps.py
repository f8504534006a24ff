"""Taps on MoE routers: whoever watches or steers a router's expert choice (the engine's route recorder, a trainer's
routing replay) attaches a tap; the router's forward then runs inside one `RouterTopK` mode that hands the ids of
its expert `torch.topk` to each active tap, those that replace the choice first, then those that only watch (so a
recorder sees the experts actually used).

Invariants:
- One pair of hooks per router, installed with its first tap and removed with its last: the pre-hook enters one
  mode for all taps, the post-hook (`always_call`: also when the forward raises) leaves it, so taps of several owners
  never unbalance torch's mode stack.
- The hooks find the taps by the module they run for: a deep copy of a tapped model (its hooks copied along) has no
  taps, and its forwards are left alone.
- Per thread: the mode a forward opened is kept per thread (two threads may run one model), at most one per router
  and forward (a deep copy's copied hooks beside its own never open a second).
- A tap acts on the thread that activated it, and a replaying tap also inside autograd's backward on any thread (the
  recomputation of a checkpointed forward, which CUDA's autograd runs on a thread of its own); never inside an engine
  step (`engine_step`) unless it is the engine's own recording tap: a trainer's routes never reach an engine's
  forward, nor a forward another thread runs meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def router_weight(router: torch.nn.Module) -> torch.Tensor | None:
    """A router's 2-D scoring weight (experts x hidden): its own `weight`, else that of the first submodule holding
    one (Ergo's router scores through a `linear` of its own); None when it has neither.

    Args:
        router: a module `find_routers` returned.
    """
    for module in router.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return weight
    return None


def num_experts(router: torch.nn.Module) -> int:
    """Experts a router chooses among (its `num_experts`, else its scoring weight's rows).

    Raises:
        ValueError: the router names no expert count and holds no 2-D weight (named).
    """
    for name in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = getattr(router, name, None)
        if isinstance(value, int):
            return value
    weight = router_weight(router)
    if weight is None:
        raise ValueError(f"{type(router).__name__} names no expert count (num_experts) and holds no 2-D weight")
    return int(weight.shape[0])


class RouterTopK(TorchFunctionMode):
    """Inside one router's forward: sees its expert choice (`torch.topk` with k == top_k over `experts` scores) and
    hands the ids to `chosen(indices)`, which may return other ids to use instead."""

    def __init__(self, top_k: int, experts: int, chosen: Callable[[torch.Tensor], torch.Tensor | None]):
        super().__init__()
        self.top_k, self.experts, self.chosen = top_k, experts, chosen

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in (torch.topk, torch.Tensor.topk):
            scores = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if k == self.top_k and dim in (-1, scores.dim() - 1) and scores.shape[-1] == self.experts:
                replaced = self.chosen(result.indices)
                if replaced is not None:
                    result = torch.return_types.topk((scores.gather(-1, replaced), replaced))
        return result


logger = logging.getLogger(__name__)
_PICKS_WITH_TOPK: dict[type, bool] = {}  # router class -> whether its forward chooses by torch.topk (probed once)


def picks_with_topk(router: torch.nn.Module) -> bool | None:
    """Whether the router's forward chooses its experts with `torch.topk` (k == top_k over its experts), as taps
    need: its forward run once per class on two tokens of zeros. None where that probe cannot run it (no 2-D
    weight, `router_weight`, or a forward taking other arguments).

    Args:
        router: a module `find_routers` returned.
    """
    kind = type(router)
    if kind not in _PICKS_WITH_TOPK:
        weight = router_weight(router)
        if weight is None:
            return None
        seen: list[bool] = []
        try:  # the forward itself, not the module's call: no hook, so no tap, sees the probe
            with torch.no_grad(), RouterTopK(router.top_k, num_experts(router), lambda ids: seen.append(True)):
                router.forward(torch.zeros(2, weight.shape[1], dtype=weight.dtype, device=weight.device))
        except Exception:  # noqa: BLE001 - another signature: the probe cannot tell
            return None
        _PICKS_WITH_TOPK[kind] = bool(seen)
    return _PICKS_WITH_TOPK[kind]


_LOCAL = threading.local()  # per thread: `open` (router id -> the mode its forward opened), `engine_step`


def in_engine_step() -> bool:
    """Whether this thread is inside an engine step's forward."""
    return getattr(_LOCAL, "engine_step", False)


@contextlib.contextmanager
def engine_step() -> Iterator[None]:
    """Mark this thread's forwards inside as an engine's: replaying taps leave them alone."""
    outer = in_engine_step()
    _LOCAL.engine_step = True
    try:
        yield
    finally:
        _LOCAL.engine_step = outer


class Tap:
    """One owner's view of a router's choice: `see(indices)` returns other ids to use (a replacing tap) or None.
    It acts on the thread that activated it; a replacing tap also in backward (any thread), never in engine steps."""

    replaces = False

    def __init__(self) -> None:
        self._thread: int | None = None  # the thread it acts on while active

    def activate(self) -> None:
        """Act on forwards of the calling thread."""
        self._thread = threading.get_ident()

    def deactivate(self) -> None:
        self._thread = None

    @property
    def active(self) -> bool:
        if self._thread is None:
            return False
        if self.replaces:
            in_backward = torch._C._current_autograd_node() is not None
            return not in_engine_step() and (self._thread == threading.get_ident() or in_backward)
        return self._thread == threading.get_ident()

    def see(self, indices: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError


_TAPS: weakref.WeakKeyDictionary[torch.nn.Module, list[Tap]] = weakref.WeakKeyDictionary()
_HOOKS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def _open_modes() -> dict[int, RouterTopK]:
    if not hasattr(_LOCAL, "open"):
        _LOCAL.open = {}
    return _LOCAL.open


def attach(router: torch.nn.Module, tap: Tap) -> None:
    """Attach `tap` to `router` (installing the router's hooks with its first tap)."""
    taps = _TAPS.setdefault(router, [])
    if router not in _HOOKS:
        _HOOKS[router] = (
            router.register_forward_pre_hook(_enter),
            router.register_forward_hook(_leave, always_call=True),
        )
        _recompile_without_stale_hooks(router)
    taps.append(tap)
    taps.sort(key=lambda each: not each.replaces)  # replacing taps first: watchers see the experts used


def _recompile_without_stale_hooks(router: torch.nn.Module) -> None:
    """Code torch.compile made while a router had no hooks never calls them (dynamo does not guard on module hooks
    by default): routes would be neither read nor replayed there, silently. So compiled code is dropped when hooks
    arrive at a router after frames were compiled while it had none, and compiles again (with them) at its next call.
    Code compiled while it had hooks calls `_enter` / `_leave`, which find the router's taps when they run: it stays
    (a `with routing_replay(...)` around each step of a compiled model does not recompile every step)."""
    from torch._dynamo.utils import counters

    compiled = counters["frames"]["ok"]
    # Frames compiled since the router last lost its hooks (never hooked: since the last reset), and since the last
    # reset (a model's routers: one reset).
    hookless_since = max(_UNHOOKED_AT.get(router, 0), _COMPILED_AT_RESET[0])
    if compiled > hookless_since:
        logger.warning("MoE router hooks added after torch.compile ran: its compiled code is reset to call them")
        torch._dynamo.reset()
        _COMPILED_AT_RESET[0] = compiled


_COMPILED_AT_RESET = [0]  # dynamo's count of compiled frames when `_recompile_without_stale_hooks` last reset
# Per router whose hooks were removed: dynamo's count of compiled frames then.
_UNHOOKED_AT: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()


def detach(router: torch.nn.Module, tap: Tap) -> None:
    """Detach `tap` (removing the router's hooks with the last tap). Idempotent."""
    taps = _TAPS.get(router)
    if taps is None or tap not in taps:
        return
    taps.remove(tap)
    if not taps:
        del _TAPS[router]
        for handle in _HOOKS.pop(router, ()):
            handle.remove()
        from torch._dynamo.utils import counters

        _UNHOOKED_AT[router] = counters["frames"]["ok"]


@torch.compiler.disable  # under torch.compile too: traced, it would decide once what every later forward replays
def _enter(router: torch.nn.Module, args: tuple) -> None:
    taps = [tap for tap in _TAPS.get(router, ()) if tap.active]
    opened = _open_modes()
    if not taps or id(router) in opened:
        return

    def chosen(indices: torch.Tensor) -> torch.Tensor | None:
        replaced = None
        for tap in taps:
            result = tap.see(indices if replaced is None else replaced)
            if tap.replaces and result is not None:
                replaced = result
        return replaced

    mode = RouterTopK(router.top_k, num_experts(router), chosen)
    mode.__enter__()
    opened[id(router)] = mode


@torch.compiler.disable
def _leave(router: torch.nn.Module, args: tuple, output: Any) -> None:
    mode = _open_modes().pop(id(router), None)
    if mode is not None:
        mode.__exit__(None, None, None)
