"""The engine's weight updates (`Engine.weight_updates`): whole-model weights and LoRA adapters, each committed
between two steps as one transaction with a policy version, the same way (`commit`): finish the step in flight, copy,
bump the policy version, forget cached prefixes, then apply the commit mode to the requests the new weights serve.
`Engine.update_weights`, `Engine.load_adapter` and `Engine.serve_adapter_from_start` document the arguments."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from rollout.config import FieldError
from rollout.engine.lora.adapter_weights import AdapterModules
from rollout.engine.requests.outputs import GenerationOutput
from rollout.engine.requests.request import Request
from rollout.engine.weights.commit_modes import abort_in_flight, recompute_in_flight
from rollout.engine.weights.weight_table import WeightTable, WeightUpdateResult
from rollout.peft_adapters import BASE_NAME

if TYPE_CHECKING:  # the engine builds both and hands them over (the step loop is the engine's, above this folder)
    from rollout.engine.runner.model_runner import ModelRunner
    from rollout.engine.step_loop import StepLoop

logger = logging.getLogger(__name__)


class WeightUpdates:
    """Checks and commits weight updates and adapters for one engine (its step loop, runner and weight table)."""

    def __init__(self, loop: StepLoop, runner: ModelRunner, table: WeightTable):
        """
        Args:
            loop: the engine's step loop (drained before a commit; its block manager holds the policy version).
            runner: the engine's model runner (its adapters, and what it derives from the weights).
            table: every name an update may target.
        """
        self.loop = loop
        self.runner = runner
        self.table = table

    @property
    def policy_version(self) -> int:
        """Version of the weights now served."""
        return self.loop.block_manager.policy_version

    def update_weights(
        self, tensors: dict[str, torch.Tensor], version: int | None, mode: str, partial: bool
    ) -> WeightUpdateResult:
        """Check, then commit, new whole-model weights (see `Engine.update_weights`)."""
        started = time.perf_counter()
        new_version = self.table.check_update(tensors, version, mode, partial, self.policy_version)
        return self.commit(lambda: self.table.copy_in(tensors), new_version, mode, started)

    def load_adapter(
        self,
        name: str,
        modules: AdapterModules,
        version: int | None,
        mode: str,
        check_finite: bool,
        base: dict[str, torch.Tensor] | None,
    ) -> WeightUpdateResult:
        """Check, then commit, a LoRA adapter, with new base weights when given (see `Engine.load_adapter`)."""
        started = time.perf_counter()
        unchanged = False
        new_version = self.table.check_version(version, mode, self.policy_version)
        self.runner.adapters.check(name, modules, check_finite)
        if base is not None:
            self.table.check_update(base, new_version, mode, False, self.policy_version)
            # The base served already (another trainer of the same checkpoint): nothing of it is copied, and the
            # adapters served beside this one compute as before. Between two steps, so no other update intervenes.
            if self.table.holds(base):
                base = None
                unchanged = True
        # Other base weights: the adapters served beside this one were pushed for the weights before.
        retiring = sorted(set(self.runner.adapters.refs) - {name}) if base is not None else []

        def copy() -> None:
            # One transaction: the adapter first, since only it allocates (new stacked layers, saved-module copies;
            # `AdapterTable.load` allocates before it writes, so a failure there leaves what is served as it was),
            # then the base, copied in place (nothing allocated). Base before adapter would leave a failed update's
            # base served under the old version, with prefixes cached from the old one.
            try:
                self.runner.adapters.load(name, modules, new_version)
            except FieldError:
                raise
            except Exception as error:  # e.g. out of memory: refused, naming what failed; nothing changed
                kind = torch.OutOfMemoryError if isinstance(error, torch.OutOfMemoryError) else RuntimeError
                what = "with new base weights " if base is not None else ""
                raise kind(
                    f"adapter {name!r}: loading it {what}failed, nothing changed (the base and the adapters served "
                    f"before serve on): {type(error).__name__}: {error}"
                ) from error
            if base is not None:
                self.table.copy_in(base)
                self._retire(retiring, name, new_version)

        def affects(request: Request) -> bool:
            return request.adapter is not None and request.adapter.name == name

        result = self.commit(copy, new_version, mode, started, None if base is not None else affects)
        result.base_unchanged = unchanged
        return result

    def _retire(self, names: list[str], name: str, version: int) -> None:
        """Stop serving the adapters `names`, pushed for the base weights adapter `name` brought others in place
        of (another trainer's base; or this trainer's, changed in place): served on, they would compute over weights
        their trainers did not train them on, with no error. Their groups end with an error saying so, as do the
        requests naming them until they are pushed again (with their base). Between two steps, the engine drained."""
        loop, adapters = self.loop, self.runner.adapters
        scheduler = loop.scheduler
        for other in names:
            reason = (
                f"adapter {other!r} is no longer served: adapter {name!r} came with other base weights than the ones "
                f"{other!r} was pushed for (policy version {version}); push {other!r} again, with its base"
            )
            queued = (*scheduler.waiting, *scheduler.running, *scheduler.swapped)
            groups = {r.group_id for r in queued if r.adapter is not None and r.adapter.name == other}
            if groups:
                loop.undelivered += loop.outputs(scheduler.abort(*sorted(groups), error=reason))
            adapters.unload(other, reason)
        if names:
            logger.warning(
                "adapter %r came with other base weights: the adapters %s, pushed for the weights before, are no "
                "longer served (their trainers push them again with their base; serve each base on its own worker)",
                name,
                names,
            )

    def unload_adapter(self, name: str) -> list[GenerationOutput]:
        """End every group sampling with adapter `name` (queued or running; finish_reason "abort"), then stop serving
        it (see `Engine.unload_adapter`). Returns their outputs (the drained step's first)."""
        loop = self.loop
        if name == BASE_NAME:
            raise FieldError("adapter", f"{BASE_NAME!r} is the base model, which is never unloaded")
        self.runner.adapters.ref(name)  # an unknown name is refused before anything ends
        loop.drain()
        scheduler = loop.scheduler
        requests = [*scheduler.waiting, *scheduler.running, *scheduler.swapped]
        groups = {r.group_id for r in requests if r.adapter is not None and r.adapter.name == name}
        outputs, loop.undelivered = loop.undelivered, []
        outputs += loop.cancel(*sorted(groups))
        self.runner.adapters.unload(name)
        return outputs

    def serve_adapter_from_start(self, name: str, modules: AdapterModules) -> None:
        """Serve an adapter at the current policy version, outside any update (see `Engine.serve_adapter_from_start`).

        Raises:
            FieldError: as `load_adapter`. RuntimeError: the engine already has requests.
        """
        if self.loop.has_unfinished():
            raise RuntimeError("adapters are served from the start only while the engine is idle: use load_adapter")
        self.runner.adapters.check(name, modules, check_finite=True)
        self.runner.adapters.load(name, modules, self.policy_version)
        # At the same policy version, prefixes cached under an earlier adapter of this name (replaced here, or
        # unloaded before) would serve their KV to the new one: cached prefixes hash the adapter's name and the
        # version only. Idle, nothing is lost but the cache (empty at a real start).
        self.loop.block_manager.reset_prefix_cache()

    def commit(
        self,
        copy: Callable[[], None],
        new_version: int,
        mode: str,
        started: float,
        affects: Callable[[Request], bool] | None = None,
    ) -> WeightUpdateResult:
        """Apply checked weights. Nothing here refuses an update except mode "wait" with samples in flight (before
        anything changed).

        Args:
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
        loop = self.loop
        loop.drain()  # the step in flight ran on the old weights: its tokens are tagged with the old version
        if mode == "wait" and loop.num_in_flight():
            raise FieldError("mode", f"'wait' needs a drained engine; {loop.num_in_flight()} samples are in flight")
        copy_started = time.perf_counter()
        copy()
        self.runner.weights_changed()
        copy_ms = (time.perf_counter() - copy_started) * 1000
        loop.block_manager.policy_version = new_version
        # Cached prefixes of old versions can never match again (the version is in their hash): let them go.
        loop.block_manager.reset_prefix_cache()
        result = WeightUpdateResult(new_version, mode, 0.0, copy_ms)
        result.outputs, loop.undelivered = loop.undelivered, []
        if mode == "recompute":
            result.recomputed = recompute_in_flight(loop.scheduler, affects)
        elif mode == "abort":
            ended, result.recomputed = abort_in_flight(loop.scheduler, affects)
            aborted = loop.outputs(ended)
            result.outputs += aborted
            result.aborted = sum(1 for output in aborted if output.finish_reason == "abort")
        # After the aborts: an aborted sample's tokens (the old weights') join its pool as it finishes.
        if loop.clear_drafts_on_update and loop.scheduler.drafter is not None:
            loop.scheduler.drafter.clear()
        loop.counters.weight_updates += 1
        result.pause_ms = (time.perf_counter() - started) * 1000
        return result
