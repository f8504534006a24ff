"""The engine `generate_batch(..., persistent_manager=True)` keeps on its model between calls: found again for the
same configs and weights, one call (one thread) at a time, and closed by `release_cached_engine`."""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

from rollout.engine.engine import Engine

# The attribute of a model that holds the engine `generate_batch(..., persistent_manager=True)` keeps for it.
CACHED_ENGINE_ATTRIBUTE = "_rollout_cached_engine"
# Guards every slot's `user`: a kept engine serves one call at a time (an engine is single-threaded).
_SLOTS_LOCK = threading.Lock()


class _EngineSlot:
    """The engine kept for one model, held in the model's own attribute (`CACHED_ENGINE_ATTRIBUTE`), as transformers
    keeps its continuous-batching manager on the model: the engine refers to its model, so a table keyed weakly by
    the model would never let either go (the value keeps its key alive), where a model dropped with its slot is one
    cycle that the garbage collector frees. A copy or a pickle of the model carries an empty slot: no engine is
    copied, and a shallow copy's shared slot answers only the model it was made for."""

    def __init__(self, model: torch.nn.Module | None = None, key: Any = None, engine: Engine | None = None) -> None:
        self.model_id = id(model) if model is not None else None  # the engine keeps the model (so its id) alive
        self.key, self.engine = key, engine
        self.user: int | None = None  # the thread whose generate_batch call runs on the engine now (None: idle)

    def __deepcopy__(self, memo: dict) -> _EngineSlot:
        return _EngineSlot()

    def __reduce__(self) -> tuple:
        return (_EngineSlot, ())


def _slot(model: torch.nn.Module) -> _EngineSlot | None:
    """The model's filled slot, if it holds one made for this very model."""
    slot = model.__dict__.get(CACHED_ENGINE_ATTRIBUTE)
    return slot if isinstance(slot, _EngineSlot) and slot.engine is not None and slot.model_id == id(model) else None


def engine_for(model: torch.nn.Module, generation_config: Any, config: Any, persistent: bool) -> tuple[Engine, bool]:
    """(engine, already warmed up): the model's cached engine when kept for these same configs, else a new one. A
    kept engine is this thread's until `done_with` (another thread's persistent call is refused meanwhile, and a
    plain call builds its own engine, leaving the kept one alone).

    Raises:
        RuntimeError: persistent, and the engine kept for the model serves another thread's call now.
    """
    # What the engine was built from: the configs (snapshots: one changed in place must not find this engine), the
    # model's own generation config, and its parameters' storage (graphs and cache read them in place).
    key = (
        generation_config,
        config,
        getattr(model, "generation_config", None),
        [p.data_ptr() for p in model.parameters()],
    )
    with _SLOTS_LOCK:
        cached = _slot(model)
        if cached is not None and cached.user is not None:  # another thread's call steps it now
            if persistent:
                raise RuntimeError(
                    "generate_batch(persistent_manager=True): the engine kept for this model is generating for "
                    "another call (another thread) now; a kept engine serves one call at a time: wait for that "
                    "call, or pass persistent_manager=False for calls that run side by side"
                )
            return Engine(model, config, generation_config), False  # its own, not kept: the kept one is in use
        if cached is not None and cached.engine.runner.closed:  # closed by its holder (cached_engine(model).close())
            del model.__dict__[CACHED_ENGINE_ATTRIBUTE]
            cached = None
        stale = None
        if persistent and cached is not None and cached.key == key:
            cached.user = threading.get_ident()
        elif cached is not None:  # idle and not reused: taken out now, so that no other thread claims it meanwhile
            del model.__dict__[CACHED_ENGINE_ATTRIBUTE]
            stale, cached = cached, None
    if persistent and cached is not None and cached.user == threading.get_ident():
        engine = cached.engine
        try:
            engine.runner.resume()
            engine.block_manager.reset_prefix_cache()  # the weights may have changed in place since
        except BaseException:
            done_with(model)
            raise
        return engine, engine.warmed_up
    if stale is not None:
        stale.engine.close()
    engine = Engine(model, config, generation_config)
    if persistent:
        slot = _EngineSlot(model, copy.deepcopy(key), engine)
        slot.user = threading.get_ident()
        with _SLOTS_LOCK:
            if _slot(model) is None:  # else another thread's call kept one meanwhile: this one is not kept
                model.__dict__[CACHED_ENGINE_ATTRIBUTE] = slot
    return engine, False


def done_with(model: torch.nn.Module) -> None:
    """This thread's call no longer uses the engine kept for `model` (if it did)."""
    with _SLOTS_LOCK:
        cached = _slot(model)
        if cached is not None and cached.user == threading.get_ident():
            cached.user = None


def cached_engine(model: torch.nn.Module) -> Engine | None:
    """The engine `generate_batch(..., persistent_manager=True)` keeps for `model`, if any.

    Args:
        model: the model given to `generate_batch`.
    """
    cached = _slot(model)
    return None if cached is None else cached.engine


def release_cached_engine(model: torch.nn.Module) -> None:
    """Close and forget the engine `generate_batch(..., persistent_manager=True)` keeps for `model` (if any).

    Args:
        model: the model given to `generate_batch`.
    Raises:
        RuntimeError: the engine is generating for a call on another thread now (it is left as it is).
    """
    with _SLOTS_LOCK:
        cached = _slot(model)
        if cached is None:
            return
        if cached.user is not None and cached.user != threading.get_ident():
            raise RuntimeError(
                "release_cached_engine: the engine kept for this model is generating for a call on another thread "
                "now; release it once that call returned"
            )
        del model.__dict__[CACHED_ENGINE_ATTRIBUTE]
    cached.engine.close()
