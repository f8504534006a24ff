"""ContinuousBatchingManager: the engine on a background thread (engine_loop.py), with queues, streaming and result
handlers; and `init_continuous_batching`, mirroring transformers' continuous batching API.

Threads: callers validate their request (`manager_requests.py`: `RequestIntake.prepare` reads no mutable engine
state), then put a command in the engine thread's mailbox; only the engine thread queues requests into the engine and
steps it. All bookkeeping shared by the two sides lives under one condition variable. Every blocking call takes a
timeout, and a stopped manager answers at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rollout.engine.engine import Engine
from rollout.engine.manager.commands import Command, PauseLoop, Wake
from rollout.engine.manager.engine_thread import EngineLoop
from rollout.engine.manager.pause import PauseGate
from rollout.engine.manager.request_api import ManagerRequests, QueueFullError
from rollout.engine.manager.results import ResultRouter
from rollout.engine.manager.weight_api import ManagerWeights
from rollout.engine.manager.weight_queue import WeightUpdateQueue
from rollout.engine.requests.outputs import GenerationOutput

__all__ = ["ContinuousBatchingManager", "QueueFullError", "init_continuous_batching"]

logger = logging.getLogger(__name__)


class ContinuousBatchingManager(ManagerRequests, ManagerWeights):
    """Runs an `Engine` on a background thread. Use `init_continuous_batching` to build one.

    Lifecycle: `start()`, `stop()`, `join()`, `is_running()`, `warmup()`, or `with manager:`. Requests:
    `add_request`, `cancel_request`. Results: `get_result`, `request_id_iter`, `register_result_handler`.
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
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._state = threading.Condition()  # guards everything below; re-entrant (handlers may call back in)
        self._router = ResultRouter(self._state)  # outputs to readers and handlers (guarded by the same lock)
        # The helpers call back into the manager through a weak proxy, never a bound method or a closure over self:
        # a reference back would put the manager, its engine and the KV cache in a cycle that only a garbage
        # collection frees. While the engine thread runs, the thread itself keeps the manager alive.
        owner = weakref.proxy(self)
        commands = self._commands
        self._pauses = PauseGate(
            lambda request: commands.put(PauseLoop(request)), lambda: owner.is_running(), lambda: owner.error
        )
        self._num_queued = 0  # groups added but not yet handed to the engine
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_id = 0
        self._loop = EngineLoop(owner)
        self._updates = WeightUpdateQueue(
            self.engine,
            self._state,
            commands.put,
            lambda outputs: owner._deliver(outputs),
            lambda: owner.is_running(),
            lambda: owner._closed,
        )
        self.started_at: float | None = None
        self.idle_s = 0.0  # seconds the engine thread waited with nothing to run (written by that thread only)
        # Called on the engine thread with each step's wall time in seconds (the worker's metrics histogram).
        self.step_observer: Callable[[float], None] | None = None
        self.error: BaseException | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> ContinuousBatchingManager:
        """Start the engine thread (no-op when already running)."""
        if self.is_running():
            return self
        if self._stop.is_set():
            raise RuntimeError("this manager was stopped; create a new one with init_continuous_batching")
        # The thread holds the manager (its args) until its loop returns: a running manager is never collected.
        self._thread = threading.Thread(target=_run_loop, args=(self,), name="rollout-engine", daemon=True)
        self.started_at = time.time()
        self._thread.start()
        return self

    def is_running(self) -> bool:
        """True while the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop the engine thread; unfinished requests end with finish_reason "abort". New requests are refused.

        Args:
            block: wait for the thread to finish.
            timeout: most seconds to wait when blocking.
        """
        if self._pauses.held_here():
            raise RuntimeError(
                "cannot stop the manager from inside its pause: the loop waits for the pause to end, so this would "
                "wait forever; leave the `with manager.pause():` block first"
            )
        self._stop.set()
        self._commands.put(Wake())
        if self._thread is None:
            self._loop.shutdown()
        elif block and threading.current_thread() is not self._thread:  # from a handler: the loop ends after it
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine thread to end (after `stop`)."""
        if self._thread is not None:
            self._thread.join(timeout)

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
        if threading.current_thread() is self._thread:
            raise RuntimeError("cannot pause from the engine thread (inside a result handler)")
        if not self.is_running():
            raise RuntimeError("cannot pause: the manager is not running") from self.error
        with self._pauses.hold(timeout):
            yield

    def _deliver(self, outputs: list[GenerationOutput]) -> None:
        self._router.deliver(outputs)

    # ---- introspection ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Queue depth, running samples, KV blocks used/free, generated tokens, uptime, and the policy version with
        the number, time (unix) and pause of weight updates (a snapshot)."""
        last = self.last_weight_update
        stats = self.engine.stats()
        stats["queued"] += self._num_queued
        stats.update(
            last_weight_update_at=self.last_weight_update_at,
            last_weight_update_pause_ms=None if last is None else last.pause_ms,
            uptime_s=0.0 if self.started_at is None else time.time() - self.started_at,
            idle_s=self.idle_s,
        )
        return stats

    # ---- results: read through the manager's router (`results.py`) -------------------------------------------
    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], None]) -> None:
        """Call `callback(output)` for every output of a request instead of queueing it: first for outputs already
        waiting, then as they come. Registered from a coroutine, the callback runs on its event loop (through
        `call_soon_threadsafe`, as in transformers); from plain code, on the engine thread. Keep it quick;
        exceptions it raises are logged. The handler is dropped once the request's last output was delivered.

        Args:
            request_id: a request (group) id or one of its sample ids; an id not added yet is remembered until
                `add_request` uses it (registering first guarantees no output is missed).
            callback: receives each `GenerationOutput`.
        """
        self._router.register_handler(request_id, callback)

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """Next output (of `request_id`'s group if given). Returns None on timeout, or at once when the manager is
        not running and nothing matching is waiting, so it never blocks forever.

        Args:
            request_id: a group id or a sample id; None takes any request's output.
            timeout: most seconds to wait (None: until an output arrives or the manager stops).
        """
        return self._router.get(request_id, timeout, self.is_running)

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """Yield the outputs of a request (deltas when streaming) until every one of its samples finished.

        Args:
            request_id: the id given to / returned by `add_request` (or one sample's id).
            timeout: most seconds to wait for each output.
        Raises:
            TimeoutError: no output came within `timeout`, or the manager stopped with the request unfinished.
        """
        return self._router.iter_request(request_id, timeout, self.is_running)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Every output, of any request, as it comes, while the manager runs (as transformers' manager)."""
        while True:
            output = self.get_result(timeout=0.1)
            if output is not None:
                yield output
            elif not self.is_running():
                return


def _run_loop(manager: ContinuousBatchingManager) -> None:
    """The engine thread's body (a function of the manager, so that the thread keeps it alive while it runs)."""
    manager._loop.run()


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
