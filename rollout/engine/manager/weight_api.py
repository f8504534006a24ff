"""The manager's weights API (`ContinuousBatchingManager` inherits it): weight updates and LoRA adapters, handed
to the engine thread (`WeightUpdateQueue`) and applied between two steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rollout.engine.lora.adapter_weights import from_peft_model, load_peft_dir, to_named_tensors
from rollout.engine.manager.commands import AdapterUpdate, PendingUpdate
from rollout.engine.requests.adapter_ref import check_adapter_name
from rollout.engine.weights.weight_table import WeightUpdateResult

if TYPE_CHECKING:
    from rollout.engine.manager.pause import PauseGate
    from rollout.engine.manager.weight_queue import WeightUpdateQueue


class ManagerWeights:
    """Weight updates and adapters of a `ContinuousBatchingManager` (its update queue and pause gate)."""

    _updates: WeightUpdateQueue
    _pauses: PauseGate

    def update_weights(
        self,
        tensors: dict[str, torch.Tensor],
        version: int | None = None,
        mode: str = "keep",
        partial: bool = False,
        timeout: float | None = None,
    ) -> WeightUpdateResult:
        """Apply new weights between two engine steps and wait for it (see `Engine.update_weights`).

        Args:
            tensors: name (as in the model's state_dict) -> new value; validated before anything changes.
            version: the new policy version (above the current one); None adds one.
            mode: "keep", "recompute", "abort" or "wait" (pause admission, let in-flight samples finish, apply).
            partial: allow a subset of the parameters.
            timeout: most seconds to wait; with mode "wait" also the most the drain may take, after which the
                update is dropped unapplied.
        Returns:
            The `WeightUpdateResult` (version, pause and copy times, aborted / recomputed counts).
        Raises:
            ValueError: a bad update, naming the field or tensor (nothing changed). TimeoutError: not applied in
            time (the old weights keep serving). RuntimeError: the manager is stopped.
        """
        if self._pauses.held_here():
            raise RuntimeError(
                "cannot wait for a weight update inside this thread's pause: the loop applies it only after the pause "
                "(copy the tensors into the model directly while paused, or update after the `with` block)"
            )
        return self._updates.apply(tensors, version, mode, partial, timeout)

    def load_adapter(
        self,
        name: str,
        adapter: Any,
        version: int | None = None,
        mode: str = "keep",
        timeout: float | None = None,
    ) -> WeightUpdateResult:
        """Serve a LoRA adapter unmerged under `name` (replacing the one of that name) between two engine steps, and
        wait for it (see `Engine.load_adapter`); requests choose it with `add_request(..., adapter=name)`.

        Args:
            name: the adapter's name.
            adapter: a PEFT adapter directory (`save_pretrained`'s), a `peft.PeftModel` (its active adapter; its
                tensors are copied), or base module name -> `LoraModule` / `SavedModule`.
            version: the new policy version (above the current one); None adds one.
            mode: "keep", "recompute", "abort" (the latter two act on this adapter's samples) or "wait".
            timeout: as for `update_weights`.
        Returns:
            The `WeightUpdateResult`.
        Raises:
            FieldError: a bad adapter (named: a tensor, `max_loras`, `max_lora_rank`, a PEFT setting that cannot be
            served unmerged), nothing changed. TimeoutError, RuntimeError: as for `update_weights`.
        """
        if self._pauses.held_here():
            raise RuntimeError("cannot wait for an adapter inside this thread's pause: load it after the `with` block")
        check_adapter_name(name, "name")
        if isinstance(adapter, str):
            modules = load_peft_dir(adapter)
        elif isinstance(adapter, dict):
            modules = adapter
        else:
            modules = from_peft_model(adapter)
        tensors, scalings = to_named_tensors(modules)
        if not isinstance(adapter, (str, dict)):  # a live model's own tensors: copies, taken now
            tensors = {name: tensor.clone() for name, tensor in tensors.items()}
        return self._updates.apply(tensors, version, mode, False, timeout, AdapterUpdate(name, scalings))

    def submit_weight_update(
        self,
        tensors: dict[str, torch.Tensor],
        version: int | None,
        mode: str,
        partial: bool,
        drain_timeout: float | None,
        callback: Callable[[WeightUpdateResult | BaseException], None],
        adapter: AdapterUpdate | None = None,
    ) -> PendingUpdate | None:
        """Queue a weight update (or, with `adapter`, a LoRA adapter's wire-named tensors) without waiting for it
        (`WeightUpdateQueue.submit`: `callback` gets the outcome)."""
        return self._updates.submit(tensors, version, mode, partial, drain_timeout, callback, adapter)

    @property
    def last_weight_update(self) -> WeightUpdateResult | None:
        """What the newest applied weight update did."""
        return self._updates.last_result

    @property
    def last_weight_update_at(self) -> float | None:
        """When (unix time) the newest weight update was applied."""
        return self._updates.last_at
