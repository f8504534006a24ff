"""ContinuousBatchingManager: the engine on a background thread (engine_loop.py), with queues, streaming and result
handlers; and `init_continuous_batching`, mirroring transformers' continuous batching API.

Threads: callers validate their request (`RequestIntake.prepare` reads no mutable engine state), then put a command
in the engine thread's mailbox; only the engine thread queues requests into the engine and steps it. All bookkeeping shared by the two sides lives
under one condition variable. Every blocking call takes a timeout, and a stopped manager answers at once.
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

from rollout.config import FieldError, SamplingParams
from rollout.engine.commands import AddGroup, CancelGroup, Command, PauseLoop, Wake
from rollout.engine.engine import Engine
from rollout.engine.engine_loop import EngineLoop
from rollout.engine.intake import TRANSFORMERS_FIELD_NAMES
from rollout.engine.manager_weights import ManagerWeights
from rollout.engine.outputs import GenerationOutput
from rollout.engine.pause import PauseGate
from rollout.engine.results import ResultReading, ResultRouter
from rollout.engine.weight_queue import WeightUpdateQueue

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Raised by `add_request` when `max_queue_size` requests are already waiting."""


class ContinuousBatchingManager(ResultReading, ManagerWeights):
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

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(
        self,
        input_ids: Any,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        n: int | None = None,
        sampling: SamplingParams | None = None,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        adapter: str | None = None,
        **sampling_fields: Any,
    ) -> str:
        """Queue a prompt for `n` samples; they share the prompt's KV.

        Args:
            input_ids: prompt token ids (a list, or a 1-D / (1, L) tensor).
            request_id: unique id (generated if None). With n > 1, sample i's outputs carry request_id "<id>#<i>".
            max_new_tokens: overrides the sampling / generation config value.
            streaming: deliver a delta (new tokens only) after every token instead of one final output.
            n: number of samples (a GRPO group; None: the GenerationConfig's num_return_sequences, else 1); sample
                i is seeded from (seed, i).
            sampling: per-request SamplingParams (copied at once); None fields come from the generation config.
            record_timestamps: outputs carry the time each token reached the host (`GenerationOutput.timestamps`).
            eos_token_id: this request's stop token(s), as in transformers' `add_request`.
            adapter: the LoRA adapter to sample with (`load_adapter`); None: the base model.
            **sampling_fields: SamplingParams fields for this request (`temperature=0.7, top_k=10`, ...), applied
                over `sampling` (or the generation config's defaults), as transformers' per-request processor
                arguments.
        Returns:
            The request (group) id.
        Raises:
            ValueError: bad input, naming the field (also a keyword that is no SamplingParams field).
            QueueFullError: `max_queue_size` requests already wait. RuntimeError: the manager was stopped.
        """
        sampling = self.engine.intake.with_fields(sampling, eos_token_id, sampling_fields)
        with self._state:
            if request_id is None:
                request_id = f"req_{self._next_id}"
                self._next_id += 1
        try:
            return self.add_group(
                request_id,
                input_ids,
                sampling=sampling,
                n=n,
                max_new_tokens=max_new_tokens,
                streaming=streaming,
                record_timestamps=record_timestamps,
                adapter=adapter,
            )
        except FieldError as error:
            raise error.renamed(TRANSFORMERS_FIELD_NAMES) from None

    def add_group(
        self,
        group_id: str,
        prompt_ids: Any,
        *,
        sampling: SamplingParams | None = None,
        n: int | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        adapter: str | None = None,
    ) -> str:
        """`add_request` in the engine's own terms (the worker's path): the arguments in `Engine.add_request`'s
        order and names, errors naming `group_id` / `prompt_ids`.

        Returns:
            `group_id`.
        Raises:
            FieldError: bad input, naming the field. QueueFullError, RuntimeError: as for `add_request`.
        """
        self.add_groups(
            [group_id],
            [prompt_ids],
            sampling=sampling,
            n=n,
            max_new_tokens=max_new_tokens,
            streaming=streaming,
            record_timestamps=record_timestamps,
            adapter=adapter,
        )
        return group_id

    def add_groups(
        self,
        group_ids: list[str],
        prompts: list[Any],
        *,
        sampling: SamplingParams | None = None,
        n: int | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        adapter: str | None = None,
    ) -> None:
        """`add_group` for several prompts with the same settings, all or none: every prompt is checked before any
        is queued, so a batch refused at its last prompt gave the engine no work.

        Raises:
            FieldError: bad input, naming the field (`prompt_ids` for any prompt). QueueFullError: the queue cannot
                take them all. RuntimeError: the manager was stopped.
        """
        if len(group_ids) != len(prompts) or len(set(group_ids)) != len(group_ids):
            raise FieldError("group_id", "one distinct group id is needed per prompt")
        requests = []
        for index, (group_id, prompt_ids) in enumerate(zip(group_ids, prompts)):
            try:
                requests.append(
                    self.engine.intake.prepare(
                        group_id, prompt_ids, sampling, n, max_new_tokens, streaming, record_timestamps, adapter
                    )
                )
            except FieldError as error:
                if len(prompts) == 1:
                    raise
                raise FieldError(error.field, f"prompt {index} of the batch: {error.reason}") from None
        with self._state:
            if self._closed:
                raise RuntimeError("the manager is stopped; create a new one with init_continuous_batching")
            for group_id in group_ids:
                if self._router.is_open(group_id):
                    raise FieldError("group_id", f"{group_id!r} is already in use by an unfinished request")
            limit = self.config.max_queue_size
            if limit and self._num_queued + self.engine.num_waiting + len(requests) > limit:
                raise QueueFullError(f"queue full: max_queue_size={limit} requests are already waiting")
            for request in requests:
                self._router.open(request.group_id, request.num_forks + 1)
                self._num_queued += 1
                self._commands.put(AddGroup(request))

    def add_requests(
        self,
        inputs: list[Any],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        **request_fields: Any,
    ) -> list[str]:
        """`add_request` for each prompt, with generated ids, in order (as transformers' `add_requests`).

        Args: as for `add_request` (`n`, `sampling`, `eos_token_id` and SamplingParams fields as keywords).
        Returns: the request ids. Raises: as `add_request`; requests added before the one that failed stay added.
        """
        if "request_id" in request_fields:
            raise TypeError("add_requests() generates one id per request; use add_request to give your own")
        common = dict(max_new_tokens=max_new_tokens, streaming=streaming, record_timestamps=record_timestamps)
        return [self.add_request(prompt, **common, **request_fields) for prompt in inputs]

    @property
    def num_return_sequences(self) -> int:
        """Samples per request when `add_request` is given no `n` (transformers' manager attribute; settable)."""
        return self.engine.intake.default_n

    @num_return_sequences.setter
    def num_return_sequences(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise FieldError("num_return_sequences", f"must be an integer >= 1, got {value!r}")
        self.engine.intake.default_n = value

    def cancel_request(self, request_id: str) -> None:
        """Abort a request (every sample of its group); each delivers its partial output with finish_reason "abort".
        Unknown or finished ids are ignored.

        Args:
            request_id: the id returned by `add_request`, or one sample's id ("<id>#<i>").
        """
        group_id = self._router.group_of(request_id)
        if group_id is not None:
            self._commands.put(CancelGroup(group_id))

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
