"""The weights half of the `Engine`'s API (the engine inherits it): the policy version, whole-model updates and LoRA
adapters committed between two steps (`WeightUpdates` does the work), the prefix cache's reset, and weights changed
in place from outside. Each call that changes what the engine serves first drains the step in flight."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rollout.engine.lora.adapter_weights import AdapterModules
from rollout.engine.requests.outputs import GenerationOutput
from rollout.engine.weights.commit_modes import recompute_in_flight
from rollout.engine.weights.weight_table import WeightUpdateResult

if TYPE_CHECKING:
    from rollout.engine.runner.model_runner import ModelRunner
    from rollout.engine.scheduling.block_manager import BlockManager
    from rollout.engine.scheduling.scheduler import Scheduler
    from rollout.engine.step_loop import StepLoop
    from rollout.engine.weights.weight_updates import WeightUpdates


class EngineWeights:
    """What the `Engine` does with weights (it sets the parts read here when built)."""

    block_manager: BlockManager
    loop: StepLoop
    runner: ModelRunner
    scheduler: Scheduler
    weight_updates: WeightUpdates

    @property
    def policy_version(self) -> int:
        """Version of the weights now served: 0 at start, then what each weight update set."""
        return self.block_manager.policy_version

    def num_in_flight(self) -> int:
        """Samples that hold KV or sampled tokens, or whose step is still on the device (what a "wait" update
        waits for)."""
        return self.loop.num_in_flight()

    def update_weights(
        self, tensors: dict[str, torch.Tensor], version: int | None = None, mode: str = "keep", partial: bool = False
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
            RuntimeError: the engine is closed (the model is the caller's again: nothing is copied into it).
        """
        self._refuse_closed("update_weights")
        return self.weight_updates.update_weights(tensors, version, mode, partial)

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
            RuntimeError: the engine is closed.
        """
        self._refuse_closed("load_adapter")
        return self.weight_updates.load_adapter(name, modules, version, mode, check_finite, base)

    def unload_adapter(self, name: str) -> list[GenerationOutput]:
        """Stop serving LoRA adapter `name`, between two steps: its groups, queued or running, end first (finish_reason
        "abort"), then its slot is zeroed and freed. The policy version does not change (no served weights did).

        Returns:
            The outputs to deliver: the step in flight's, then the ended samples' final ones.
        Raises:
            FieldError: ("adapter") no adapter of that name is served (nothing ended).
            RuntimeError: the engine is closed.
        """
        self._refuse_closed("unload_adapter")
        return self.weight_updates.unload_adapter(name)

    def _refuse_closed(self, what: str) -> None:
        """Raise when the engine is closed: its model is the caller's again, so a weight change must not go through
        (an update copied into the caller's model and bumped the version of an engine that serves nothing)."""
        if self.runner.closed:
            raise RuntimeError(f"{what}() of a closed engine: build a new one")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> int:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`): later prompts are computed anew; blocks in use
        keep their contents and their requests go on.

        Args:
            reset_running_requests: also drop the KV of every running and swapped sample and queue it to be computed
                again from its tokens, ahead of new requests (vLLM's flag: after weights changed in place with mode
                "keep", the samples go on under the new ones, as a "recompute" update would have had them).
        Returns:
            How many samples were reset (0 without `reset_running_requests`).
        """
        reset = 0
        if reset_running_requests:
            self.loop.drain()  # the step in flight ends first (its outputs wait for the next step)
            reset = recompute_in_flight(self.scheduler)
        self.block_manager.reset_prefix_cache()
        return reset

    def serve_adapter_from_start(self, name: str, modules: AdapterModules) -> None:
        """Serve an adapter from the engine's start, at the current policy version and outside any weight update
        (`rollout-worker --lora`): call it before the first request.

        Raises:
            FieldError: as `load_adapter`. RuntimeError: the engine already has requests, or is closed.
        """
        self._refuse_closed("serve_adapter_from_start")
        self.weight_updates.serve_adapter_from_start(name, modules)

    def weights_changed(self) -> None:
        """Say that the model's weights were changed in place from outside the engine (while a manager was paused,
        by a trainer's step): what the engine derives from them (the fp32 head's copy) is refreshed, and the cached
        prefixes, whose keys and values the old weights made, are forgotten."""
        self.runner.weights_changed()
        self.block_manager.reset_prefix_cache()
