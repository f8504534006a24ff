"""`GroupCounters`: the generation groups a worker received, refused and finished, and its samples' finish reasons,
counted alike whichever door they came through (ZeroMQ or HTTP). `stats()` and /metrics read them."""

from __future__ import annotations

import threading

from rollout.engine.requests.request import FINISH_REASONS


class GroupCounters:
    """Counters written from the serving, HTTP and engine threads, read from any (one lock: a `+=` is not atomic)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.received = self.refused = self.finished = 0
        self._finish_reasons = dict.fromkeys(FINISH_REASONS, 0)

    def group_received(self) -> None:
        """A group was accepted by the engine."""
        with self._lock:
            self.received += 1

    def group_refused(self) -> None:
        """A generation request was answered with an error instead."""
        with self._lock:
            self.refused += 1

    def group_finished(self) -> None:
        """Every sample of a group finished."""
        with self._lock:
            self.finished += 1

    def sample_finished(self, reason: str) -> None:
        """A sample ended, for `reason` (stop, length, abort or error)."""
        with self._lock:
            self._finish_reasons[reason] = self._finish_reasons.get(reason, 0) + 1

    def snapshot(self) -> dict[str, object]:
        """groups_received, groups_refused, groups_finished, groups_in_flight (received, not finished) and
        samples_finished (reason -> count)."""
        with self._lock:
            return {
                "groups_received": self.received,
                "groups_refused": self.refused,
                "groups_finished": self.finished,
                "groups_in_flight": self.received - self.finished,
                "samples_finished": dict(self._finish_reasons),
            }
