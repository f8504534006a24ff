"""The generation pause (vLLM's `pause_generation`, what an orchestrator asks for around a weight update): the
engine thread stops stepping until `resume_generation()`, but goes on taking commands, so that requests queue up,
cancels end samples, and weight updates and adapters are committed while nothing runs.

Not the manager's `pause()` (transformers'): that one holds the engine thread itself for one caller's block, to use
the model in place; this one lasts from one call to another, across callers (two HTTP requests).

What happens to the samples in flight is the pause's mode, in the terms of a weight update's commit modes:
- "keep": they stay where they are, their KV cache kept, and go on from there once resumed (a weight update
  committed meanwhile with mode "keep" lets them continue on their old KV: each token's version says which weights);
- "wait": admission stops and they run to their end; the pause takes hold once none is left;
- "abort": every group queued or running ends now (finish_reason "abort"), then the pause takes hold.

States: "running", "draining" (a "wait" pause whose samples still run; already counted as paused), "paused".
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.config import FieldError
from rollout.engine.engine import Engine
from rollout.engine.requests.outputs import GenerationOutput

# What a generation pause does with the samples in flight (vLLM's PauseMode values).
GENERATION_PAUSE_MODES = ("keep", "wait", "abort")


class PauseOvertaken(RuntimeError):
    """A "wait" pause that never took hold: generation was resumed while its samples still ran (a conflict between
    two callers, not a failure of the worker)."""


@dataclass
class PauseOutcome:
    """What a pause or resume did, handed back to its caller."""

    changed: bool  # the state changed (False: already paused, or resumed while running)
    aborted: int = 0  # samples a pause of mode "abort" ended
    held: int = 0  # samples in flight, kept, when the pause took hold (mode "keep")


@dataclass
class GenerationPauseCommand:
    """Pause (`mode`) or resume (`mode` None) generation; the outcome (or an exception) goes to `reply`."""

    mode: str | None
    # Forget cached prefixes once the pause holds, in every mode: samples a "keep" pause holds keep their own KV (its
    # blocks stay theirs), but no later prompt finds it (vLLM's code honours clear_cache with "keep" too).
    clear_cache: bool = False
    reply: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)


class GenerationPause:
    """The engine thread's side of the generation pause (it alone changes `state`; others only read it)."""

    def __init__(self, engine: Engine, deliver: Callable[[list[GenerationOutput]], None]):
        """
        Args:
            engine: the engine the loop steps.
            deliver: hands outputs (of the step in flight, of aborted samples) to their readers.
        """
        self.engine = engine
        self.deliver = deliver
        self.state = "running"
        self._draining: list[GenerationPauseCommand] = []  # "wait" pauses answered once the engine has drained

    @property
    def paused(self) -> bool:
        """True from a pause until the resume (also while a "wait" pause drains)."""
        return self.state != "running"

    @property
    def holds(self) -> bool:
        """True while the loop must not step."""
        return self.state == "paused"

    def apply(self, command: GenerationPauseCommand) -> None:
        """Engine thread: carry out a pause or resume (a "wait" pause is answered later, by `advance`). A pause
        while paused applies its mode again (vLLM's): "abort" ends what queued meanwhile, "wait" lets samples a
        "keep" pause held run to their end."""
        if command.mode is None:
            was_paused = self.paused
            self.state = "running"
            self.engine.resume_admission()
            for waiting in self._draining:  # resumed before it drained: the pause never took hold
                waiting.reply.put(PauseOvertaken("generation was resumed before the in-flight samples finished"))
            self._draining.clear()
            command.reply.put(PauseOutcome(changed=was_paused))
            return
        if command.mode not in GENERATION_PAUSE_MODES:
            command.reply.put(
                FieldError("mode", f"must be one of {list(GENERATION_PAUSE_MODES)}, got {command.mode!r}")
            )
            return
        was_paused = self.paused
        self.deliver(self.engine.flush())  # the step in flight finishes on its own: its outputs go out
        if command.mode == "abort":
            aborted = abort_open_groups(self.engine, self.deliver)
            self._hold(command, PauseOutcome(changed=not was_paused, aborted=aborted))
        elif command.mode == "wait":
            self.state = "draining"
            self.engine.pause_admission()
            self._draining.append(command)
            self.advance()  # nothing in flight: it holds at once
        else:
            self._hold(command, PauseOutcome(changed=not was_paused, held=self.engine.num_in_flight()))

    def advance(self) -> None:
        """Engine thread, between two steps: a draining pause takes hold once no sample is in flight; until then
        nothing new is admitted (again each time: a weight update committed meanwhile resumes admission)."""
        if self.state == "draining":
            self.engine.pause_admission()
        if self.state == "draining" and not self.engine.num_in_flight():
            self.deliver(self.engine.flush())
            self._hold(self._draining[0], PauseOutcome(changed=True))

    def _hold(self, command: GenerationPauseCommand, outcome: PauseOutcome) -> None:
        """The pause takes hold: `command` gets `outcome`, "wait" pauses still draining (overtaken by this one)
        their own. The cache is cleared when any of them asked for it (each answered pause did what it asked)."""
        self.state = "paused"
        self.engine.resume_admission()  # once resumed, queued requests are admitted as before
        waiting, self._draining = self._draining, []
        if command.clear_cache or any(other.clear_cache for other in waiting):
            self.engine.reset_prefix_cache()
        for other in waiting:
            if other is not command:
                other.reply.put(PauseOutcome(changed=True))
        command.reply.put(outcome)

    def refuse_waiting(self, reason: str) -> None:
        """Engine thread, at shutdown: pauses still draining are answered with an error."""
        for command in self._draining:
            command.reply.put(RuntimeError(reason))
        self._draining.clear()


def abort_open_groups(engine: Engine, deliver: Callable[[list[GenerationOutput]], None]) -> int:
    """Engine thread: end every group queued or running, of every client (finish_reason "abort"), delivering their
    outputs; returns how many samples were ended."""
    outputs = engine.cancel(*engine.open_group_ids())
    deliver(outputs)
    return sum(1 for output in outputs if output.finish_reason == "abort")
