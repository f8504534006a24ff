"""The parts a `ContinuousBatchingManager` is the public face of, built around what they share: one mailbox (the
engine thread's commands) and one condition variable (the bookkeeping of both sides: requests on their way, result
readers and handlers, weight updates).

The parts call back into the manager through a weak proxy, never a bound method or a closure over it: a reference
back would put the manager, its engine and the KV cache in a cycle that only a garbage collection frees. While the
engine thread runs, the thread itself keeps the manager alive.
"""

from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Protocol

from rollout.engine.engine import Engine
from rollout.engine.manager.commands import Command, PauseLoop
from rollout.engine.manager.engine_thread import EngineLoop, LoopOwner
from rollout.engine.manager.generation_pause import GenerationPause
from rollout.engine.manager.pause import PauseGate
from rollout.engine.manager.request_desk import RequestDesk
from rollout.engine.manager.results import ResultRouter
from rollout.engine.manager.serving_control import ServingControl
from rollout.engine.manager.weight_queue import WeightUpdateQueue


class PartsOwner(LoopOwner, Protocol):
    """What the parts read of the manager (structural: this module does not import the manager)."""

    def is_running(self) -> bool: ...


@dataclass(frozen=True)
class ManagerParts:
    """A manager's parts, wired to each other (see the module docstring)."""

    commands: queue.SimpleQueue[Command]  # the engine thread's mailbox
    state: threading.Condition  # guards the shared bookkeeping; re-entrant (handlers may call back in)
    router: ResultRouter  # outputs to readers and handlers (guarded by the same lock)
    requests: RequestDesk  # groups checked on the caller's thread, posted to the mailbox
    pauses: PauseGate
    weight_updates: WeightUpdateQueue
    loop: EngineLoop  # the engine thread's body
    control: ServingControl  # the generation pause, prefix cache resets, adapter unloads

    @classmethod
    def build(cls, manager: PartsOwner, engine: Engine) -> ManagerParts:
        """Make the parts of `manager`, which holds `engine`.

        Args:
            manager: the manager they serve (held through a weak proxy only).
            engine: the manager's engine (the engine thread alone steps it).
        """
        commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        state = threading.Condition()
        router = ResultRouter(state)
        requests = RequestDesk(
            engine.intake, lambda: engine.num_waiting, engine.config.max_queue_size, state, router, commands
        )
        owner = weakref.proxy(manager)
        pauses = PauseGate(
            lambda request: commands.put(PauseLoop(request)), lambda: owner.is_running(), lambda: owner.error
        )
        # Built here, not by the loop: the weight queue reads it, and a closure over the loop would make a cycle.
        generation = GenerationPause(engine, router.deliver)
        weight_updates = WeightUpdateQueue(
            engine,
            state,
            commands.put,
            router.deliver,
            lambda: owner.is_running(),
            lambda: requests.closed,
            pauses.held_here,
            lambda: generation.holds,
        )
        loop = EngineLoop(owner, engine, requests, weight_updates, commands, state, router.deliver, generation)
        control = ServingControl(
            engine,
            generation,
            commands.put,
            router.deliver,
            lambda: owner.is_running(),
            lambda: owner.error,
            loop.on_thread,
            lambda: requests.closed,
        )
        return cls(commands, state, router, requests, pauses, weight_updates, loop, control)
