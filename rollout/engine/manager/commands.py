"""What other threads ask of the manager's engine thread: one small dataclass per command, put in its mailbox
(`queue.SimpleQueue`) and applied between two engine steps, in the order they came."""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.engine.manager.generation_pause import GenerationPauseCommand
from rollout.engine.manager.pause import PauseRequest
from rollout.engine.requests.request import Request
from rollout.engine.weights.weight_table import WeightUpdateResult


@dataclass
class AddGroup:
    """Queue a prepared group (its leader request) in the engine."""

    request: Request


@dataclass
class CancelGroup:
    """Abort every unfinished sample of a group."""

    group_id: str


@dataclass
class PauseLoop:
    """Stop the loop between two steps until the pause is released (pause.py)."""

    request: PauseRequest


@dataclass
class AdapterUpdate:
    """What makes a pending update a LoRA adapter's: its name and per-module scalings (the tensors are wire-named,
    "<module>.lora_A" / "<module>.lora_B")."""

    name: str
    scalings: dict[str, float]


@dataclass
class PendingUpdate:
    """A weight update handed to the engine thread; a "wait" one stays pending while in-flight samples drain."""

    tensors: dict[str, torch.Tensor]
    version: int | None
    mode: str
    partial: bool
    callback: Callable[[WeightUpdateResult | BaseException], None]
    drain_deadline: float | None
    received: float = 0.0
    adapter: AdapterUpdate | None = None  # a LoRA adapter (Engine.load_adapter), else a whole-model update
    # "pending" until the engine thread takes it ("applying"), or its waiter gave up first ("cancelled"); changed
    # only under the manager's lock, so an update is either applied and reported, or never applied.
    state: str = "pending"


@dataclass
class ApplyWeights:
    """Apply a weight update between two steps (once in-flight samples drained, for mode "wait")."""

    update: PendingUpdate


class AnswerTo:
    """An `EngineCall`'s reply handed to a callback, for a caller that must not wait for it (the ZeroMQ worker's
    serving thread). The callback runs on the engine thread, once: it must be quick and must not raise."""

    def __init__(self, callback: Callable[[Any], None]):
        """
        Args:
            callback: gets the call's result, or the exception it raised (RuntimeError: the manager stopped first).
        """
        self.put = callback


@dataclass
class EngineCall:
    """Run `function(engine)` on the engine thread between two steps (the step in flight finished first); its
    result, or the exception it raised, goes to `reply` (a queue its caller waits on, or an `AnswerTo`)."""

    function: Callable[[Any], Any]
    reply: queue.SimpleQueue | AnswerTo = field(default_factory=queue.SimpleQueue)


@dataclass
class Wake:
    """Nothing to do: makes a waiting loop look at its stop flag."""


Command = AddGroup | CancelGroup | PauseLoop | ApplyWeights | GenerationPauseCommand | EngineCall | Wake
