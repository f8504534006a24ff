"""ContinuousBatchingManager: the engine on a background thread, with queues, streaming and result handlers; and
`init_continuous_batching`, mirroring transformers' continuous batching API.

The manager is the public face of the objects it holds (`parts.py`, built around one mailbox and one condition
variable): its `RequestDesk` (requests checked on the caller's thread, then posted to the engine thread's mailbox),
`WeightUpdateQueue`, `PauseGate`, `ResultRouter` (outputs to readers and handlers) and `EngineLoop` (the engine
thread's body). Only the engine thread queues requests into the engine and steps it. Every blocking call takes a
timeout, and a stopped manager answers at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rollout.engine.engine import Engine
from rollout.engine.manager.exit_stop import stop_at_exit
from rollout.engine.manager.parts import ManagerParts
from rollout.engine.manager.request_adding import RequestAdding
from rollout.engine.manager.request_desk import QueueFullError
from rollout.engine.manager.result_reading import ResultReading
from rollout.engine.weights.weight_table import WeightUpdateResult
from rollout.validation import check_timeout

logger = logging.getLogger(__name__)

__all__ = ["ContinuousBatchingManager", "QueueFullError", "init_continuous_batching"]


class ContinuousBatchingManager(RequestAdding, ResultReading):
    """Runs an `Engine` on a background thread. Use `init_continuous_batching` to build one.

    Lifecycle: `start()`, `stop()`, `join()`, `is_running()`, `warmup()`, `pause()`, or `with manager:`. Requests:
    `add_request`, `add_groups`, `cancel_request`. Results: `get_result`, `request_id_iter`,
    `register_result_handler`. Weights: `update_weights`, `load_adapter`, and `weight_updates` (a
    `WeightUpdateQueue`: `submit` queues an update without waiting, `last_result` is what the newest one did).
    Control: `control` (a `ServingControl`: vLLM's `pause_generation` / `resume_generation` / `is_paused`,
    `reset_prefix_cache`, `unload_adapter`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: Any = None,
        continuous_batching_config: Any = None,
        tokenizer: Any = None,
    ):
        """
        Args:
            model: a transformers causal LM.
            generation_config: a `transformers.GenerationConfig` with defaults for requests (merged with the
                model's own generation config as `generate` does).
            continuous_batching_config: engine settings: rollout's or transformers' ContinuousBatchingConfig (see
                `Engine`), or None for the defaults.
            tokenizer: the model's tokenizer, for stop strings (`SamplingParams.stop`); None refuses them.
        """
        self.engine = Engine(model, continuous_batching_config, generation_config, tokenizer)
        self.config = self.engine.config
        self.generation_config = generation_config  # as given (transformers' manager has it too)
        parts = ManagerParts.build(self, self.engine)
        self._router, self._requests, self._pauses, self._loop = parts.router, parts.requests, parts.pauses, parts.loop
        self.weight_updates = parts.weight_updates
        self.control = parts.control
        self.started_at: float | None = None
        self.stopped_at: float | None = None  # (unix) when the engine thread ended: the uptime counts no further
        self.idle_s = 0.0  # seconds the engine thread waited with nothing to run (written by that thread only)
        # Called on the engine thread with each step's wall time in seconds (the worker's metrics histogram).
        self.step_observer: Callable[[float], None] | None = None
        self.error: BaseException | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> ContinuousBatchingManager:
        """Start the engine thread (no-op when already running)."""
        if not self.is_running():
            self._loop.start(keep_alive=self)  # the thread holds the manager: a running manager is never collected
            self.started_at = time.time()
            stop_at_exit(self)  # stopped at interpreter exit if it still runs then
        return self

    def is_running(self) -> bool:
        """True while the engine thread runs."""
        return self._loop.is_running()

    def _on_engine_thread(self) -> bool:
        return self._loop.on_thread()

    def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = True,
    ) -> None:
        """Stop the engine thread; new requests are refused at once.

        Args:
            block: wait for the thread to finish.
            timeout: most seconds to wait when blocking.
            keep_for_next_session: refused when True (transformers caches its manager on the model for the next
                `generate_batch`; rollout keeps an engine with `generate_batch(..., persistent_manager=True)`).
            hard_stop: True (rollout's default): unfinished requests end at once with finish_reason "abort".
                False (transformers' default): the requests already added run to their end first, then the thread
                stops (at once, as with True, while a `pause_generation` holds).
        Raises:
            ValueError: keep_for_next_session is True.
            RuntimeError: called from inside this manager's `pause()`.
        """
        if keep_for_next_session:
            raise ValueError(
                "keep_for_next_session: not supported; a manager does not restart. To keep an engine between "
                "calls, use generate_batch(..., persistent_manager=True)"
            )
        if self._pauses.held_here():
            raise RuntimeError(
                "cannot stop the manager from inside its pause: the loop waits for the pause to end, so this would "
                "wait forever; leave the `with manager.pause():` block first"
            )
        if hard_stop:
            self._loop.stop(block, timeout)
            return
        self._requests.close()
        self._loop.flush_and_stop()
        if block and not self._loop.on_thread():
            self._loop.join(timeout)

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        """Wait for the engine thread to end (after `stop`). Transformers' signature: `join(stop_trigger_time,
        timeout)`; pass a timeout by name (`join(timeout=5)`), a lone positional number is `stop_trigger_time`.

        Args:
            stop_trigger_time: the `time.perf_counter()` at which the stop was asked; when given, how long the thread
                took to end after it is logged (info), as transformers does.
            timeout: most seconds to wait; None waits until it ends. A thread still running after it is logged
                (warning), as transformers does.
        Raises:
            RuntimeError: called from a result handler, which runs on the engine thread: it would wait on itself.
            FieldError: a timeout or stop_trigger_time that is no number of seconds.
        """
        check_timeout(timeout)
        check_timeout(stop_trigger_time, "stop_trigger_time")
        if self._loop.on_thread():
            raise RuntimeError(
                "join() cannot wait on the engine thread from inside a result handler, which runs on it; call "
                "stop(block=False) there, and join() from another thread"
            )
        self._loop.join(timeout)
        if self._loop.is_running():
            logger.warning("the engine thread did not end within join's timeout (%ss)", timeout)
        elif stop_trigger_time is not None:
            logger.info("the engine thread stopped %.2fs after the stop", time.perf_counter() - stop_trigger_time)

    def __enter__(self) -> ContinuousBatchingManager:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop(block=True)

    def warmup(self, num_tokens: int = 8) -> None:
        """Pay first-step costs up front (see `Engine.warmup`: a short request, then every decode CUDA graph).
        Call it before `start()`.

        Args:
            num_tokens: length of the warm-up prompt.
        """
        if self.is_running():
            raise RuntimeError("warmup() must be called before start()")
        self.engine.warmup(num_tokens)

    def destroy(self) -> None:
        """Stop the manager for good and release the engine (safe to call more than once; it cannot restart)."""
        self.stop(block=True)

    @contextmanager
    def pause(self, timeout: float | None = None) -> Iterator[None]:
        """Pause the engine loop between two steps, e.g. to use or change the model in place; requests in flight
        and the KV cache are kept, and the loop resumes when the block exits (as transformers' `pause`). Several
        threads pausing take turns. `stop()` from another thread waits until the pause ends; from inside the block
        it raises.

        Args:
            timeout: most seconds to wait for the loop to pause (None: as long as one step takes).
        Raises:
            RuntimeError: the manager is not running or stops before pausing (its error, if any, as the cause), or
                this is the engine thread (a result handler). A thread already inside a pause may nest another.
            TimeoutError: the loop did not pause in time (it then does not pause at all).
        """
        check_timeout(timeout)
        if self._loop.on_thread():
            raise RuntimeError("cannot pause from the engine thread (inside a result handler)")
        if not self.is_running():
            raise RuntimeError("cannot pause: the manager is not running") from self.error
        with self._pauses.hold(timeout):
            yield

    # ---- weights: applied between two steps through the manager's `WeightUpdateQueue` ---------------------------
    def update_weights(
        self,
        tensors: dict[str, torch.Tensor],
        version: int | None = None,
        mode: str = "keep",
        partial: bool = False,
        timeout: float | None = None,
    ) -> WeightUpdateResult:
        """Apply new weights between two engine steps and wait for it. Updates sent from several threads apply one
        after another, in the order they arrived (one behind a "wait" update waits for its drain).

        Args:
            tensors: the new weights, as for `Engine.update_weights` (validated before anything changes).
            version: the new policy version (must exceed the current one); None adds one.
            partial: allow updating a subset of the parameters.
            mode: "keep", "recompute", "abort" or "wait" (pause admission, let in-flight samples finish, apply).
            timeout: most seconds to wait; with mode "wait" also the most the drain may take, after which the
                update is dropped unapplied.
        Returns:
            The `WeightUpdateResult` (version, pause and copy times, aborted / recomputed counts).
        Raises:
            ValueError: a bad update, naming the field or tensor (nothing changed).
            TimeoutError: not applied in time (the old weights keep serving).
            RuntimeError: the manager is stopped, or this thread holds its pause, or is the engine thread (a result
                handler: the update waits for that thread; `weight_updates.submit` does not).
        """
        check_timeout(timeout)
        self._refuse_waiting_for_update("update_weights")
        return self.weight_updates.apply(tensors, version, mode, partial, timeout)

    def load_adapter(
        self, name: str, adapter: Any, version: int | None = None, mode: str = "keep", timeout: float | None = None
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
                served unmerged), nothing changed.
            TimeoutError: as for `update_weights`.
            RuntimeError: as for `update_weights`.
        """
        check_timeout(timeout)
        self._refuse_waiting_for_update("load_adapter")
        return self.weight_updates.apply_adapter(name, adapter, version, mode, timeout)

    def _refuse_waiting_for_update(self, what: str) -> None:
        if self._loop.on_thread():  # the engine thread applies it, between two steps: it would wait on itself
            raise RuntimeError(
                f"{what} cannot wait on the engine thread (inside a result handler), which applies it; queue it with "
                "weight_updates.submit instead"
            )

    # ---- introspection ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Queue depth, running samples, KV blocks used/free, generated tokens, uptime, whether generation is paused
        (`control.pause_generation`), and the policy version with the number, time (unix) and pause of weight updates
        (a snapshot)."""
        last = self.weight_updates.last_result
        stats = self.engine.stats()
        stats["queued"] += self._requests.num_queued
        stats.update(
            last_weight_update_at=self.weight_updates.last_at,
            last_weight_update_pause_ms=None if last is None else last.pause_ms,
            uptime_s=0.0 if self.started_at is None else (self.stopped_at or time.time()) - self.started_at,
            idle_s=self.idle_s,
            generation_paused=self.control.is_paused,
        )
        return stats


def init_continuous_batching(
    model: torch.nn.Module,
    generation_config: Any = None,
    continuous_batching_config: Any = None,
    tokenizer: Any = None,
) -> ContinuousBatchingManager:
    """Build a (not yet started) `ContinuousBatchingManager` for `model`.

    Args:
        model: a transformers causal LM.
        generation_config: default sampling settings (`transformers.GenerationConfig`), merged with the model's own.
        continuous_batching_config: engine settings: rollout's or transformers' ContinuousBatchingConfig (see
            `Engine`), or None for the defaults.
        tokenizer: the model's tokenizer, for stop strings (`SamplingParams.stop`); None refuses them.
    """
    return ContinuousBatchingManager(model, generation_config, continuous_batching_config, tokenizer)
