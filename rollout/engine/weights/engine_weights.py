"""The engine's weights API (`Engine` inherits it): whole-model weight updates and LoRA adapters, each committed
between two steps as one transaction with a policy version, the same way (`commit`): finish the step in flight, copy,
bump the policy version, forget cached prefixes, then apply the commit mode to the requests the new weights serve."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from rollout.config import FieldError
from rollout.engine.lora.adapter_weights import AdapterModules
from rollout.engine.requests.request import Request
from rollout.engine.weights.commit_modes import abort_in_flight, recompute_in_flight
from rollout.engine.weights.weight_table import WeightUpdateResult

if TYPE_CHECKING:
    from rollout.engine.requests.outputs import GenerationOutput
    from rollout.engine.runner.model_runner import ModelRunner
    from rollout.engine.sampling.pending_samples import InFlightStep
    from rollout.engine.scheduling.block_manager import BlockManager
    from rollout.engine.scheduling.scheduler import Scheduler
    from rollout.engine.weights.weight_table import WeightTable


class EngineWeights:
    """Weight updates and adapters of an `Engine` (its scheduler, runner and weight table)."""

    scheduler: Scheduler
    runner: ModelRunner
    weights: WeightTable
    block_manager: BlockManager
    _in_flight: InFlightStep | None
    _undelivered: list[GenerationOutput]
    num_weight_updates: int
    has_unfinished: Callable[[], bool]
    _drain: Callable[[], None]
    _outputs: Callable[[list[Request]], list[GenerationOutput]]

    @property
    def policy_version(self) -> int:
        """Version of the weights now served: 0 at start, then what each weight update set."""
        return self.block_manager.policy_version

    def num_in_flight(self) -> int:
        """Samples that hold KV or sampled tokens, or whose step is still on the device (what a "wait" update
        waits for)."""
        return len(self.scheduler.in_flight()) or int(self._in_flight is not None)

    def update_weights(
        self,
        tensors: dict[str, torch.Tensor],
        version: int | None = None,
        mode: str = "keep",
        partial: bool = False,
    ) -> WeightUpdateResult:
        """Copy new weights into the model in place, all at once, between two steps; bump the policy version.

        Everything is validated first: a bad update changes nothing. In-place copies keep the model's tensors (and
        anything captured against them) valid.

        Args:
            tensors: name (as in the model's state_dict) -> new value.
            version: the new policy version (must exceed the current one); None adds one.
            mode: what happens to in-flight samples: "keep" (continue on their old KV), "recompute" (re-prefill
                prompt + tokens so far under the new weights), "abort" (end now with finish_reason "abort";
                samples that have not sampled yet are recomputed instead), "wait" (only valid once nothing is in
                flight: the manager pauses admission and drains first).
            partial: allow updating a subset of the parameters.
        Returns:
            A `WeightUpdateResult`; its `outputs` are the aborted samples' final outputs, for the caller to deliver.
        Raises:
            FieldError: a bad mode, version or tensor (named); nothing was changed (a "wait" refused for samples in
                flight has finished the step in flight first: its outputs come with the next `step()`).
        """
        started = time.perf_counter()
        new_version = self.weights.check_update(tensors, version, mode, partial, self.policy_version)
        return commit(self, lambda: self.weights.copy_in(tensors), new_version, mode, started)

    def load_adapter(
        self,
        name: str,
        modules: AdapterModules,
        version: int | None = None,
        mode: str = "keep",
        check_finite: bool = False,
        base: dict[str, torch.Tensor] | None = None,
    ) -> WeightUpdateResult:
        """Serve a LoRA adapter unmerged under `name` (replacing the one of that name), between two steps: a weight
        update like `update_weights`, with a policy version, that leaves the base weights untouched.

        Args:
            name: the adapter's name (requests choose it: `add_request(..., adapter=name)`).
            modules: base module name -> `LoraModule` (lora_A, lora_B, scaling) for a Linear it adapts, or
                `SavedModule` for a module it trains whole (modules_to_save); `lora_weights.load_peft_dir` reads a
                PEFT adapter directory into this form.
            version: the new policy version (must exceed the current one); None adds one.
            mode: as for `update_weights`; "recompute" and "abort" act on this adapter's samples only.
            check_finite: refuse tensors holding NaN or Inf.
            base: whole new base weights (state_dict names) committed with the adapter, in the same transaction
                (an adapter push to a worker that does not serve the trainer's base yet).
        Returns:
            A `WeightUpdateResult`.
        Raises:
            FieldError: a bad name, tensor (unknown module, shape, rank above max_lora_rank), mode or version, or
                max_loras adapters served already (named); nothing was changed.
        """
        started = time.perf_counter()
        new_version = self.weights.check_version(version, mode, self.policy_version)
        self.runner.adapters.check(name, modules, check_finite)
        if base is not None:
            self.weights.check_update(base, new_version, mode, False, self.policy_version)

        def copy() -> None:
            if base is not None:
                self.weights.copy_in(base)
            self.runner.adapters.load(name, modules, new_version)

        def affects(request: Request) -> bool:
            return request.adapter is not None and request.adapter.name == name

        return commit(self, copy, new_version, mode, started, None if base is not None else affects)

    def serve_adapter_from_start(self, name: str, modules: AdapterModules) -> None:
        """Serve an adapter from the engine's start, at the current policy version and outside any weight update
        (`rollout-worker --lora`): call it before the first request.

        Raises:
            FieldError: as `load_adapter`. RuntimeError: the engine already has requests.
        """
        if self.has_unfinished():
            raise RuntimeError("adapters are served from the start only while the engine is idle: use load_adapter")
        self.runner.adapters.check(name, modules, check_finite=True)
        self.runner.adapters.load(name, modules, self.policy_version)

    def weights_changed(self) -> None:
        """Say that the model's weights were changed in place from outside the engine (while a manager was paused,
        by a trainer's step): what the engine derives from them (the fp32 head's copy) is refreshed."""
        self.runner.weights_changed()


def commit(
    engine: EngineWeights,
    copy: Callable[[], None],
    new_version: int,
    mode: str,
    started: float,
    affects: Callable[[Request], bool] | None = None,
) -> WeightUpdateResult:
    """Apply checked weights. Nothing here refuses an update except mode "wait" with samples in flight (before
    anything changed).

    Args:
        engine: the engine.
        copy: copies the checked tensors into place.
        new_version: the policy version they set.
        mode: "keep", "recompute", "abort" or "wait" (see `Engine.update_weights`).
        started: `time.perf_counter()` when the update's checks began (its pause counts from there).
        affects: which in-flight requests "recompute" and "abort" act on (None: all of them).
    Returns:
        The `WeightUpdateResult`, with the drained step's outputs and the aborted samples' final ones.
    Raises:
        FieldError: ("mode") "wait" while samples are in flight.
    """
    engine._drain()  # the step in flight ran on the old weights: its tokens are tagged with the old version
    if mode == "wait" and engine.num_in_flight():
        raise FieldError("mode", f"'wait' needs a drained engine; {engine.num_in_flight()} samples are in flight")
    copy_started = time.perf_counter()
    copy()
    engine.runner.weights_changed()
    copy_ms = (time.perf_counter() - copy_started) * 1000
    engine.block_manager.policy_version = new_version
    # Cached prefixes of old versions can never match again (the version is in their hash): let them go.
    engine.block_manager.reset_prefix_cache()
    result = WeightUpdateResult(new_version, mode, 0.0, copy_ms)
    result.outputs, engine._undelivered = engine._undelivered, []
    if mode == "recompute":
        result.recomputed = recompute_in_flight(engine.scheduler, affects)
    elif mode == "abort":
        ended, result.recomputed = abort_in_flight(engine.scheduler, affects)
        aborted = engine._outputs(ended)
        result.outputs += aborted
        result.aborted = sum(1 for output in aborted if output.finish_reason == "abort")
    engine.num_weight_updates += 1
    result.pause_ms = (time.perf_counter() - started) * 1000
    return result
