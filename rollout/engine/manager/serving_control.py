"""`ServingControl` (`manager.control`): what an operator or orchestrator does to a running manager besides adding
requests and weights, each carried out by the engine thread between two steps: the generation pause
(`generation_pause.py`), forgetting cached prefixes, and unloading a LoRA adapter. vLLM's engine client has the
same calls (`pause_generation`, `resume_generation`, `is_paused`, `reset_prefix_cache`); its HTTP control routes
are built on them (`rollout.service.http.control`)."""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Callable
from typing import Any

from rollout.engine.engine import Engine
from rollout.engine.manager.commands import AnswerTo, Command, EngineCall
from rollout.engine.manager.generation_pause import (
    GenerationPause,
    GenerationPauseCommand,
    PauseOutcome,
    abort_open_groups,
)
from rollout.engine.requests.outputs import GenerationOutput

# How often a caller waiting for the engine thread's answer checks that the thread still runs.
POLL_S = 0.1
# How often a coroutine waiting for it looks (it holds no thread meanwhile).
ASYNC_POLL_S = 0.02


class ServingControl:
    """Control calls on one manager's engine (thread-safe; each waits for the engine thread's answer)."""

    def __init__(
        self,
        engine: Engine,
        generation: GenerationPause,
        post: Callable[[Command], None],
        deliver: Callable[[list[GenerationOutput]], None],
        is_running: Callable[[], bool],
        error: Callable[[], Any],
        on_engine_thread: Callable[[], bool] = lambda: False,
        is_closed: Callable[[], bool] = lambda: False,
    ):
        """
        Args:
            engine: the manager's engine (touched here only while its thread does not run).
            generation: the engine loop's generation pause (its state is read here, changed by the engine thread).
            post: puts a command in the engine thread's mailbox.
            deliver: hands outputs (of ended samples) to their readers, when the call runs here.
            is_running: whether the engine thread runs (else calls run in the caller's thread).
            error: the engine thread's error, if it died of one.
            on_engine_thread: whether the caller is the engine thread (a result handler): it would wait on itself.
            is_closed: whether the manager stopped for good (then every call is refused).
        """
        self._engine = engine
        self._generation = generation
        self._post = post
        self._deliver = deliver
        self._is_running = is_running
        self._error = error
        self._on_engine_thread = on_engine_thread
        self._is_closed = is_closed

    # ---- the generation pause -------------------------------------------------------------------------------
    def pause_generation(
        self, mode: str = "abort", clear_cache: bool = True, timeout: float | None = None
    ) -> PauseOutcome:
        """Stop generating until `resume_generation()` (vLLM's `pause_generation`). Requests added meanwhile, from
        any client, wait in the queue; cancels, weight updates and adapters still go in (a "wait" update with
        samples held is refused: it could never drain). A pause while paused applies its mode again.

        Args:
            mode: what happens to the samples in flight: "keep" (held, KV kept, go on once resumed), "wait" (run to
                their end first; returns once none is left), "abort" (every queued and running group ends now,
                finish_reason "abort"). vLLM's default is "abort".
            clear_cache: forget cached prefixes once paused (with "keep" too: held samples keep their own KV, but no
                later prompt finds it).
            timeout: most seconds to wait for the pause to hold (None: as long as a "wait" drain takes). On timeout
                the pause still holds later: call `resume_generation()` to undo it.
        Returns:
            A `PauseOutcome` (whether it changed anything, samples aborted or held).
        Raises:
            FieldError: ("mode") an unknown mode. TimeoutError: not paused in time. RuntimeError: the manager
                stopped, or it was resumed before a "wait" drain ended.
        """
        return self._ask(GenerationPauseCommand(mode, bool(clear_cache)), self._generation.apply, timeout)

    async def pause_generation_async(self, mode: str = "abort", clear_cache: bool = True) -> PauseOutcome:
        """`pause_generation` for a coroutine: it waits on its event loop, holding no thread while a "wait" pause
        drains (the HTTP route). A caller that gives up does not undo the pause (as vLLM's)."""
        command = GenerationPauseCommand(mode, bool(clear_cache))
        self._send(command, self._generation.apply)
        while command.reply.empty():
            if not self._is_running():
                raise RuntimeError("the manager stopped before it answered") from self._error()
            await asyncio.sleep(ASYNC_POLL_S)
        return self._answered(command.reply.get())

    def resume_generation(self) -> bool:
        """Generate again after `pause_generation` (held samples go on, queued requests are admitted). Resuming
        when not paused changes nothing. Returns whether generation was paused."""
        return self._ask(GenerationPauseCommand(None), self._generation.apply, None).changed

    @property
    def is_paused(self) -> bool:
        """True from `pause_generation` until `resume_generation` (also while a "wait" pause drains)."""
        return self._generation.paused

    def abort_all(self, timeout: float | None = None) -> int:
        """End every group queued or running, of every client (finish_reason "abort"; vLLM's /abort_requests without
        ids). Returns how many samples were ended."""
        return self.call(lambda engine: abort_open_groups(engine, self._deliver), timeout)

    # ---- the engine's caches and adapters -------------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix (blocks in use keep their contents and their samples go on). Returns True: the
        reset never fails (vLLM's may, while requests run).

        Args:
            reset_running_requests: also have every running and swapped sample compute its KV again from its tokens
                (`Engine.reset_prefix_cache`), as vLLM's flag preempts them.
        """
        self.call(lambda engine: engine.reset_prefix_cache(bool(reset_running_requests)))
        return True

    def unload_adapter(self, name: str, timeout: float | None = None) -> None:
        """Stop serving LoRA adapter `name`: its groups, queued or running, end with finish_reason "abort", then
        its slot is freed (see `Engine.unload_adapter`).

        Args:
            name: a served adapter's name.
            timeout: most seconds to wait for the engine thread.
        Raises:
            FieldError: ("adapter") no adapter of that name is served. TimeoutError, RuntimeError: as `call`.
        """

        self.call(self._unload(name), timeout)

    def submit_unload_adapter(self, name: str, done: Callable[[int | BaseException], None]) -> None:
        """`unload_adapter` without waiting (the ZeroMQ worker's `adapter_unload`: its serving thread never waits on
        the engine thread).

        Args:
            name: a served adapter's name.
            done: gets how many samples the unload ended (finish_reason "abort"), or the exception (FieldError
                "adapter": no adapter of that name is served; RuntimeError: the manager stopped first). It runs once,
                on the engine thread (here, when that thread has not started): it must be quick and must not raise.
        Raises:
            RuntimeError: the manager stopped (`done` is not called).
        """
        self._send(EngineCall(self._unload(name), AnswerTo(done)), self._run_here)

    def _unload(self, name: str) -> Callable[[Engine], int]:
        """What the engine thread runs to unload adapter `name`: delivers the ended samples, returns how many."""

        def unload(engine: Engine) -> int:
            outputs = engine.unload_adapter(name)
            self._deliver(outputs)
            return sum(1 for output in outputs if output.finish_reason == "abort")

        return unload

    def call(self, function: Callable[[Engine], Any], timeout: float | None = None) -> Any:
        """Run `function(engine)` between two steps (the step in flight finished first) and return its result.

        Raises:
            What `function` raised; TimeoutError when the engine thread did not run it in time (it may still run
            it later); RuntimeError when the manager stopped first.
        """
        return self._ask(EngineCall(function), self._run_here, timeout)

    def _run_here(self, call: EngineCall) -> None:
        """Carry out `call` on the caller's thread (the engine thread has not started), as that thread would."""
        try:
            self._deliver(self._engine.flush())
            answer = call.function(self._engine)
        except Exception as error:  # noqa: BLE001 - the caller hears of it, as from the engine thread
            answer = error
        try:
            call.reply.put(answer)
        finally:  # a raised answer's traceback holds this frame: not the answer too
            answer = None

    def _send(self, command: GenerationPauseCommand | EngineCall, run_here: Callable) -> None:
        """Hand `command` to the engine thread, or carry it out here when the thread has not started.

        Raises:
            RuntimeError: the caller is the engine thread (it would wait on itself), or the manager stopped.
        """
        if self._on_engine_thread():
            raise RuntimeError("cannot wait for the engine thread from itself (inside a result handler)")
        if self._is_closed():
            raise RuntimeError("the manager is stopped") from self._error()
        if not self._is_running():
            run_here(command)  # not started yet: nothing else touches the engine
        else:
            self._post(command)

    @staticmethod
    def _answered(answer: Any) -> Any:
        if isinstance(answer, BaseException):
            try:
                raise answer
            finally:  # the traceback keeps this frame, not the error: no cycle to collect
                answer = None
        return answer

    def _ask(self, command: GenerationPauseCommand | EngineCall, run_here: Callable, timeout: float | None) -> Any:
        """Hand `command` to the engine thread (`_send`) and wait for its answer; an exception answered is raised."""
        self._send(command, run_here)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"the engine thread did not answer within {timeout} s")
            try:
                answer = command.reply.get(timeout=POLL_S if remaining is None else min(POLL_S, remaining))
                break
            except queue.Empty:
                if not self._is_running() and command.reply.empty():
                    raise RuntimeError("the manager stopped before it answered") from self._error()
        try:
            return self._answered(answer)
        finally:  # the raised answer's traceback holds this frame: not the answer too
            answer = None
