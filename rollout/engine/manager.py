"""ContinuousBatchingManager: the engine on a background thread, with queues, streaming and result handlers; plus
`generate_batch` and `init_continuous_batching`, mirroring transformers' continuous batching API.

Threads: callers only enqueue commands and read results; the engine thread alone touches the engine. Every blocking
call takes a timeout, and a stopped manager answers at once instead of blocking.
"""

from __future__ import annotations

import itertools
import numbers
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tqdm.auto import tqdm

from rollout.config import DEFAULT_MAX_NEW_TOKENS, ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import Engine, GenerationOutput

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Raised by `add_request` when `max_queue_size` requests are already waiting."""


class ContinuousBatchingManager:
    """Runs an `Engine` on a background thread. Use `init_continuous_batching` to build one.

    Lifecycle: `start()`, `stop()`, `join()`, `is_running()`, `warmup()`, or `with manager:`. Requests:
    `add_request`, `cancel_request`. Results: `get_result`, `request_id_iter`, `register_result_handler`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        generation_config: Any = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
    ):
        """
        Args:
            model: a transformers causal LM.
            generation_config: a `transformers.GenerationConfig` giving defaults for requests without SamplingParams
                (and the stop tokens / max_new_tokens of those with); None uses `model.generation_config`.
            continuous_batching_config: engine settings; None uses the defaults.
        """
        self.config = continuous_batching_config or ContinuousBatchingConfig()
        self.generation_config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
        self.default_sampling = SamplingParams.from_generation_config(self.generation_config)
        self.engine = Engine(model, self.config)
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._results: deque[GenerationOutput] = deque()
        self._results_ready = threading.Condition()
        self._handlers: dict[str, Callable[[GenerationOutput], None]] = {}
        self._open: dict[str, list[str]] = {}  # group id -> sample ids, until every sample finished
        self._samples_left: dict[str, int] = {}
        # group id -> finished samples not yet read by get_result (request_id_iter needs the group size until then)
        self._unread: dict[str, int] = {}
        self._lock = threading.Lock()
        self._num_queued = 0  # groups added but not yet handed to the engine
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.started_at: float | None = None
        self.error: BaseException | None = None

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> ContinuousBatchingManager:
        """Start the engine thread (no-op when already running)."""
        if self.is_running():
            return self
        if self._stop.is_set():
            raise RuntimeError("this manager was stopped; create a new one with init_continuous_batching")
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
        self.started_at = time.time()
        self._thread.start()
        return self

    def is_running(self) -> bool:
        """True while the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop the engine thread; unfinished requests end with finish_reason "abort".

        Args:
            block: wait for the thread to finish.
            timeout: most seconds to wait when blocking.
        """
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is None:
            self._shutdown()
        elif block:
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
        """Run one short request through the engine so first-step costs (allocator, kernels) are paid up front.
        Call it before `start()`; it forgets the warm-up prompt's cached prefix afterwards."""
        if self.is_running():
            raise RuntimeError("warmup() must be called before start()")
        sampling = SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=2)
        self.engine.add_request("__warmup__", [0] * num_tokens, sampling)
        while self.engine.has_unfinished():
            self.engine.step()
        self.engine.block_manager.reset_prefix_cache()

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        n: int = 1,
        sampling: SamplingParams | None = None,
    ) -> str:
        """Queue a prompt for `n` samples; they share the prompt's KV.

        Args:
            input_ids: prompt token ids.
            request_id: unique id (generated if None). With n > 1, sample i's outputs carry request_id "<id>#<i>".
            max_new_tokens: overrides the sampling / generation config value.
            streaming: deliver a delta (new tokens only) after every token instead of one final output.
            n: number of samples (a GRPO group); sample i is seeded from (seed, i).
            sampling: per-request SamplingParams; None fields are filled from the generation config.
        Returns:
            The request (group) id.
        Raises:
            ValueError: bad input, naming the field. QueueFullError: `max_queue_size` requests already wait.
        """
        if request_id is None:
            request_id = f"req_{next(self._ids)}"
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.flatten().tolist()
        # numpy / torch integer scalars become plain ints; anything else is left for validate() to name.
        input_ids = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in input_ids]
        sampling = self._resolve_sampling(sampling)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n: must be an integer >= 1, got {n!r}")
        max_new = max_new_tokens if max_new_tokens is not None else sampling.max_new_tokens
        max_new = DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new
        SamplingParams(max_new_tokens=max_new)  # raises naming max_new_tokens when invalid
        self.engine.validate(input_ids, sampling, max_new)
        with self._lock:
            if request_id in self._open:
                raise ValueError(f"request_id: {request_id!r} is already in use by an unfinished request")
            limit = self.config.max_queue_size
            if limit and self._num_queued + self.engine.scheduler.num_waiting >= limit:
                raise QueueFullError(f"queue full: max_queue_size={limit} requests are already waiting")
            self._open[request_id] = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
            self._samples_left[request_id] = n
            self._unread[request_id] = n
            self._num_queued += 1
        self._commands.put(("add", (request_id, list(input_ids), sampling, n, max_new, streaming)))
        return request_id

    def cancel_request(self, request_id: str) -> None:
        """Abort a request (every sample of its group); each delivers its partial output with finish_reason "abort".

        Args:
            request_id: the id returned by `add_request`, or one sample's id ("<id>#<i>").
        """
        group_id = request_id
        if group_id not in self._open and "#" in request_id:
            group_id = request_id.rsplit("#", 1)[0]
        self._commands.put(("cancel", group_id))

    def _resolve_sampling(self, sampling: SamplingParams | None) -> SamplingParams:
        if sampling is None:
            return self.default_sampling
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
        fill = {}
        if sampling.stop_token_ids is None:
            fill["stop_token_ids"] = self.default_sampling.stop_token_ids
        if sampling.max_new_tokens is None and self.default_sampling.max_new_tokens is not None:
            fill["max_new_tokens"] = self.default_sampling.max_new_tokens
        return sampling.merged(**fill) if fill else sampling

    # ---- results ----------------------------------------------------------------------------------------------
    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], None]) -> None:
        """Call `callback(output)` on the engine thread for every output of `request_id` (instead of queueing it).
        Keep it quick; exceptions it raises are logged and ignored."""
        self._handlers[request_id] = callback

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """Next output (of `request_id`'s group if given). Returns None on timeout, or at once when the manager is
        not running and nothing matching is pending (so it never blocks forever).

        Args:
            request_id: a group id or a sample id; None takes any request's output.
            timeout: most seconds to wait (None: until an output arrives or the manager stops).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._results_ready:
            while True:
                for index, output in enumerate(self._results):
                    if request_id is None or request_id in (output.group_id, output.request_id):
                        del self._results[index]
                        if output.is_finished:
                            self._mark_read(output.group_id)
                        return output
                if not self.is_running() and self._commands.empty():
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._results_ready.wait(0.1 if remaining is None else min(remaining, 0.1))

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """Yield the outputs of a request (deltas when streaming) until every one of its samples finished.

        Args:
            request_id: the id given to / returned by `add_request`.
            timeout: most seconds to wait for each output; the iterator ends early if it passes.
        """
        samples_left = self._unread.get(request_id, 1)
        while samples_left:
            output = self.get_result(request_id, timeout)
            if output is None:
                return
            samples_left -= output.is_finished
            yield output

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
        except BaseException as error:  # noqa: BLE001 - report to every waiter instead of dying silently
            logger.exception("engine thread failed")
            self.error = error
        finally:
            self._shutdown(reason=None if self.error is None else f"engine thread failed: {self.error!r}")

    def _shutdown(self, reason: str | None = None) -> None:
        """End everything still queued or running and give the model its attention implementation back."""
        self._abort_all(reason)
        self.engine.close()

    def drain_commands(self) -> None:
        """Hand queued requests and cancellations to the engine now. Only for callers that drive the engine
        themselves (generate_batch) while the engine thread is not running."""
        if self.is_running():
            raise RuntimeError("drain_commands() would race with the running engine thread")
        self._drain_commands(block=False)

    def _drain_commands(self, block: bool) -> None:
        try:
            command, payload = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command, payload)
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: str, payload: Any) -> None:
        if command == "add":
            request_id, input_ids, sampling, n, max_new, streaming = payload
            with self._lock:
                self._num_queued -= 1
            try:
                self.engine.add_request(request_id, input_ids, sampling, n, max_new, streaming)
            except ValueError as error:  # validated at submit time; a failure here still reaches the caller
                self._end_unstarted(request_id, input_ids, "error", str(error))
        elif command == "cancel":
            self._deliver(self.engine.cancel(payload))

    def _end_unstarted(self, group_id: str, prompt_ids: list[int], reason: str, error: str | None) -> None:
        """Final outputs for a group the engine never took (rejected late, or the manager stopped first)."""
        sample_ids = self._open.get(group_id, [group_id])
        outputs = [
            GenerationOutput(sid, group_id, i, list(prompt_ids), finish_reason=reason, error=error, is_finished=True)
            for i, sid in enumerate(sample_ids)
        ]
        self._deliver(outputs)

    def _deliver(self, outputs: list[GenerationOutput]) -> None:
        if not outputs:
            return
        queued = []
        for output in outputs:
            handler = self._handlers.get(output.group_id)
            if handler is not None:
                try:
                    handler(output)
                except Exception:  # noqa: BLE001
                    logger.exception("result handler for %s raised", output.group_id)
                if output.is_finished:
                    self._mark_read(output.group_id)
            else:
                queued.append(output)
            if output.is_finished:
                self._sample_finished(output.group_id)
        with self._results_ready:
            self._results.extend(queued)
            self._results_ready.notify_all()

    def _mark_read(self, group_id: str) -> None:
        with self._lock:
            left = self._unread.get(group_id, 1) - 1
            if left > 0:
                self._unread[group_id] = left
            else:
                self._unread.pop(group_id, None)

    def _sample_finished(self, group_id: str) -> None:
        with self._lock:
            left = self._samples_left.get(group_id, 0) - 1
            if left > 0:
                self._samples_left[group_id] = left
                return
            self._samples_left.pop(group_id, None)
            self._open.pop(group_id, None)
        self._handlers.pop(group_id, None)

    def _abort_all(self, reason: str | None = None) -> None:
        """End everything still queued or running (on stop, or when the engine thread died)."""
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "add":
                with self._lock:
                    self._num_queued -= 1
                self._end_unstarted(payload[0], payload[1], "abort" if reason is None else "error", reason)
        for group_id in list(self._open):
            outputs = self.engine.cancel(group_id)
            if reason is not None:
                for output in outputs:
                    output.finish_reason, output.error = "error", reason
            self._deliver(outputs)

    # ---- introspection ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Queue depth, running samples, KV blocks used/free, generated tokens and uptime (a snapshot)."""
        engine = self.engine
        return {
            "queued": self._num_queued + engine.scheduler.num_waiting,
            "running": len(engine.scheduler.running),
            "kv_blocks_used": engine.block_manager.num_used_blocks,
            "kv_blocks_free": engine.block_manager.num_free_blocks,
            "generated_tokens": engine.num_generated_tokens,
            "steps": engine.num_steps,
            "preemptions": engine.scheduler.num_preemptions,
            "uptime_s": 0.0 if self.started_at is None else time.time() - self.started_at,
        }


def init_continuous_batching(
    model: torch.nn.Module,
    generation_config: Any = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
) -> ContinuousBatchingManager:
    """Build a (not yet started) `ContinuousBatchingManager` for `model`.

    Args:
        model: a transformers causal LM.
        generation_config: default sampling settings (`transformers.GenerationConfig`); None: the model's own.
        continuous_batching_config: engine settings.
    """
    return ContinuousBatchingManager(model, generation_config, continuous_batching_config)


def generate_batch(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: Any = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    progress_bar: bool = True,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """Generate completions for a list of prompts with continuous batching and return them all.

    Runs the engine loop in the calling thread (no background thread: nothing to hand over between threads).

    Args:
        model: a transformers causal LM.
        inputs: prompts as lists of token ids.
        generation_config: a `transformers.GenerationConfig` for default sampling settings.
        continuous_batching_config: engine settings.
        progress_bar: show a tqdm bar of finished samples.
        **kwargs: `sampling` (one SamplingParams, or one per prompt), `max_new_tokens`, `n` (samples per prompt).
    Returns:
        Outputs keyed by sample request id ("req_<i>", or "req_<i>#<j>" when n > 1), in input order.
    Raises:
        ValueError: bad input, naming the field (nothing is generated then).
    """
    sampling = kwargs.pop("sampling", None)
    max_new_tokens = kwargs.pop("max_new_tokens", None)
    n = kwargs.pop("n", 1)
    if kwargs:
        raise TypeError(f"generate_batch() got unexpected keyword arguments: {sorted(kwargs)}")
    per_prompt = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(inputs)
    if len(per_prompt) != len(inputs):
        raise ValueError(f"sampling: got {len(per_prompt)} SamplingParams for {len(inputs)} prompts")
    manager = init_continuous_batching(model, generation_config, continuous_batching_config)
    engine = manager.engine
    results: dict[str, GenerationOutput] = {}
    try:
        order = []
        for index, (prompt, params) in enumerate(zip(inputs, per_prompt)):
            # The manager validates and resolves defaults exactly as for a served request; its queue is drained here.
            group = manager.add_request(prompt, f"req_{index}", max_new_tokens, n=n, sampling=params)
            order += [group] if n == 1 else [f"{group}#{i}" for i in range(n)]
        manager.drain_commands()
        with tqdm(total=len(order), disable=not progress_bar, desc="generate_batch", unit="seq") as bar:
            while engine.has_unfinished():
                for output in engine.step():
                    results[output.request_id] = output
                    bar.update(1)
        # Requests the engine refused when they were handed over end with an error output in the manager's queue.
        while (output := manager.get_result(timeout=0)) is not None:
            results[output.request_id] = output
    finally:
        manager.stop(block=True)
    return {request_id: results[request_id] for request_id in order}
