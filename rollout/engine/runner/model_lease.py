"""The model lent to the engines that use it: paged attention, eval mode and a sync-free experts implementation while
any engine holds it, and everything given back exactly as found when the last one lets go.

MoE models: transformers' "eager" experts loop over the experts the router picked, reading which ones back to the
host (`nonzero`, `item`), which stalls every step on a GPU and makes decode steps impossible to capture in CUDA
graphs. While lent, such a model runs transformers' own "grouped_mm" experts (one grouped matrix product, no host
read), or "batched_mm" where grouped_mm cannot dispatch. An engine with `batch_invariant` asks for "eager" instead:
one `F.linear` per expert, which the invariant mode tiles, as the trainer's `batch_invariant` block runs them (a
grouped product's bits for a token depend on how many tokens its expert got, and differ from the trainer's).

A lease belongs to the transformers model itself: a peft model holds the same one (`get_base_model()`), shares its
config and its switch, so it shares its lease, whichever of the two an engine was given. `LEASE_LOCK` serializes the
lease and the build-time probe, so engines built at once from several threads see one another.

`ModelHold` is one runner's share: what it put on the model, given back at its `close()`, or when it is freed
unclosed (an engine never closed: a finalizer).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import torch

from rollout.attention_settings import AttentionSettings
from rollout.engine.attention.paged import register_paged_attention
from rollout.engine.runner.training_mode import TrainingMode

logger = logging.getLogger(__name__)

# Experts implementations that read nothing back to the host, in order of preference.
SYNC_FREE_EXPERTS = ("grouped_mm", "batched_mm")
# What a batch-invariant engine runs: the trainer's `batch_invariant` block runs the same.
INVARIANT_EXPERTS = ("eager",)


@dataclass
class _Holder:
    """What the engines sharing one model must give back when the last one closes."""

    engines: int
    attention: AttentionSettings  # every config's own attention implementation, as found
    training: TrainingMode  # every submodule's training flag (and kernels mode), as found, of each model lent
    experts_implementation: dict | None = None  # the model's own, when the lease switched it
    experts_choices: tuple[str, ...] = SYNC_FREE_EXPERTS  # what the engines holding it asked for


_HOLDERS: weakref.WeakKeyDictionary[torch.nn.Module, _Holder] = weakref.WeakKeyDictionary()
# Held around a lease's change and around the probe with its "is it leased?" check (model_checks.py): reentrant, as
# the probe's caller may hold it while it asks.
LEASE_LOCK = threading.RLock()


def leased_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model a lease belongs to: a peft model's base transformers model, else `model` itself.

    Args:
        model: what an engine was given.
    """
    get_base_model = getattr(model, "get_base_model", None)  # peft's PeftModel (transformers' models have none)
    if not callable(get_base_model):
        return model
    try:
        return get_base_model()
    except Exception:  # noqa: BLE001 - its active adapter deleted since (get_base_model reads that adapter's config)
        tuner = model.base_model  # a LoRA tuner around the model, or the model itself (prompt learning)
        return getattr(tuner, "model", tuner)


def acquire(model: torch.nn.Module, experts: tuple[str, ...] = SYNC_FREE_EXPERTS) -> torch.nn.Module:
    """Take the model for one more engine (the first one switches it, an MoE model's experts to the first of
    `experts` that dispatches included; later ones share the switch, and put in eval mode what the first one did
    not hold: a peft model's wrappers and adapter layers). Returns the leased model, for `release` (a peft model's
    base: the wrapper may change meanwhile).

    Args:
        model: a transformers causal LM, or a peft model around one.
        experts: the experts implementations an MoE model may run while lent, in order of preference
            (`SYNC_FREE_EXPERTS`, or `INVARIANT_EXPERTS` for a batch-invariant engine).
    Raises:
        ValueError: another engine holds the model with other experts (a batch-invariant engine beside an ordinary
            one on one MoE model).
    """
    with LEASE_LOCK:
        leased = leased_model(model)
        holder = _HOLDERS.get(leased)
        if holder is None:
            holder = _Holder(0, AttentionSettings.of(leased), TrainingMode.of(model), experts_choices=experts)
            holder.experts_implementation = _switch_experts(leased, experts)
            leased.set_attn_implementation(register_paged_attention())
            _HOLDERS[leased] = holder
        else:
            check_lease(leased, experts)
            holder.training = holder.training.including(model)
        model.eval()
        holder.engines += 1
        return leased


def check_lease(model: torch.nn.Module, experts: tuple[str, ...]) -> None:
    """Refuse an engine whose experts choice differs from the engines that hold `model` now (before it builds
    anything).

    Raises:
        ValueError: a batch-invariant engine beside an ordinary one on one MoE model (named).
    """
    model = leased_model(model)
    holder = _HOLDERS.get(model)
    if holder is not None and holder.experts_choices != experts and _has_experts(model):
        raise ValueError(
            "batch_invariant: another engine holds this MoE model with batch_invariant="
            f"{holder.experts_choices == INVARIANT_EXPERTS}; engines sharing one MoE model must agree on it"
        )


def is_leased(model: torch.nn.Module) -> bool:
    """Whether an engine holds `model` now, or the model a peft model wraps (its attention is switched to the paged
    one and must stay so)."""
    return leased_model(model) in _HOLDERS


def release(model: torch.nn.Module) -> None:
    """Let go of the model for one engine; the last one gives everything back as it was.

    Args:
        model: what `acquire` returned.
    """
    with LEASE_LOCK:
        holder = _HOLDERS[model]
        holder.engines -= 1
        if holder.engines == 0:
            del _HOLDERS[model]
            holder.attention.restore()
            if holder.experts_implementation is not None:
                model.set_experts_implementation(holder.experts_implementation)
            holder.training.restore()


def _has_experts(model: torch.nn.Module) -> bool:
    """Whether the model has experts whose implementation can be switched."""
    get = getattr(model, "get_experts_implementation", None)
    return get is not None and any(value is not None for value in get().values())


def _switch_experts(model: torch.nn.Module, choices: tuple[str, ...]) -> dict | None:
    """Set the first of `choices` that dispatches, unless the model's experts run one of them already; the model's
    own setting when it was switched, else None."""
    get = getattr(model, "get_experts_implementation", None)
    if get is None:
        return None
    own = get()
    if all(value is None or value in choices for value in own.values()):
        return None  # no experts, or already one of the choices
    for choice in choices:
        try:
            model.set_experts_implementation({key: choice if value is not None else None for key, value in own.items()})
        except (ValueError, ImportError, RuntimeError) as error:  # transformers refuses what cannot dispatch here
            logger.debug("experts implementation %r not available: %s", choice, error)
            continue
        return own
    if choices == INVARIANT_EXPERTS:
        raise ValueError(f"batch_invariant: this MoE model's experts cannot run transformers' 'eager' loop ({own})")
    logger.warning("no sync-free experts implementation available (%s): MoE decode steps read the host", own)
    return None


class ModelHold:
    """What a `ModelRunner` put on its model: the parts that hook it (closed once) and its lease (None while
    suspended or closed). Held weakly, so that the finalizer's hold on this object keeps no model alive: a model
    dropped with its runner needs nothing given back."""

    def __init__(self, parts: list) -> None:
        self.parts = [weakref.ref(part) for part in parts]
        self._leased: weakref.ref[torch.nn.Module] | None = None

    @property
    def leased(self) -> torch.nn.Module | None:
        return None if self._leased is None else self._leased()

    @leased.setter
    def leased(self, model: torch.nn.Module | None) -> None:
        self._leased = None if model is None else weakref.ref(model)

    def close_parts(self) -> None:
        parts, self.parts = self.parts, []
        for ref in parts:
            part = ref()
            if part is not None:
                part.close()

    def release_lease(self) -> None:
        leased, self.leased = self.leased, None
        if leased is not None:
            release(leased)

    def give_back(self) -> None:
        """Everything, for a runner freed without `close()`."""
        self.close_parts()
        self.release_lease()
