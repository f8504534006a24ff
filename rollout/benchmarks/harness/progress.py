"""Progress lines of long benchmarks, on stderr as they happen: a run killed at its time limit still shows in its log
how far it got."""

from __future__ import annotations

import sys
import time

_STARTED = time.monotonic()


def stage(message: str) -> None:
    """Print one progress line on stderr, flushed, with the seconds since this process started benchmarking.

    Args:
        message: what starts now (or what just finished).
    """
    print(f"[{time.monotonic() - _STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)
