"""A progress bar over an in-process engine's samples that also moves while they all run together.

Samples of one batch tend to finish together at the end, so a bar of finished samples alone sits at 0% for most of
a run; its postfix says how many tokens were generated so far and at what rate, read from the engine's counters.
"""

from __future__ import annotations

import time
from typing import Any

from tqdm.auto import tqdm

from rollout.engine.counters import StepCounters

REFRESH_S = 0.5  # how often the tokens postfix is redrawn between finished samples


class QuietBar(tqdm):
    """tqdm without its monitor thread: that thread (which redraws bars left waiting) outlived the bar for the
    process's life; the bars here are redrawn by their owner's steps."""

    monitor_interval = 0


class SampleProgress:
    """A tqdm bar of finished samples with a "tokens" and "tok/s" postfix; a context manager (closes the bar).

    Call `after_step(finished)` after each engine step with the number of samples it finished.
    """

    def __init__(self, counters: StepCounters, total: int, enabled: bool, desc: str | None = None) -> None:
        """
        Args:
            counters: the engine's counters (`Engine.counters`); the postfix counts from their value now.
            total: the samples the bar counts to.
            enabled: show the bar (False: every call does nothing).
            desc: the bar's label.
        """
        self._counters = counters
        self._start_tokens = counters.generated_tokens
        self._start = self._last_drawn = time.monotonic()
        self.bar: Any = QuietBar(total=total, disable=not enabled, desc=desc, unit="seq")

    def after_step(self, finished: int) -> None:
        """Count `finished` samples; redraw the tokens postfix at most every `REFRESH_S` seconds."""
        if self.bar.disable:
            return
        now = time.monotonic()
        if now - self._last_drawn >= REFRESH_S or finished:
            self._last_drawn = now
            tokens = self._counters.generated_tokens - self._start_tokens
            rate = tokens / max(now - self._start, 1e-9)
            # refresh only when no update below redraws it, so a step draws the bar at most once
            self.bar.set_postfix({"tokens": tokens, "tok/s": f"{rate:.1f}"}, refresh=not finished)
        if finished:
            self.bar.update(finished)

    def close(self) -> None:
        """Close the bar (its last line stays on the terminal, as tqdm's do)."""
        self.bar.close()

    def __enter__(self) -> SampleProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
