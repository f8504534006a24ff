"""Staleness, one rule for every way of running ahead of the trainer (`AsyncRollouts`, its partial rollouts, TRL's
async and partial modes): a step's groups must be sampled with weights at most `max_staleness` versions older than
the step's; with `stale_policy="regenerate"` an older group is generated again, and a group still too old after that
means the workers lag behind the pushes (an error, never an endless loop); with "is_correct" it is kept (the trainer
corrects for it)."""

from __future__ import annotations

from collections.abc import Hashable

from trainer_bridge.client.calls import GroupResult, RolloutError, oldest_version

STALE_POLICIES = ("regenerate", "is_correct")


class StalenessGate:
    """One step's check of its groups' age: which must be generated again, and when that cannot help."""

    def __init__(self, oldest_allowed: int, stale_policy: str, hint: str = ""):
        """
        Args:
            oldest_allowed: the oldest policy version a group of this step may hold (the step's version minus
                max_staleness).
            stale_policy: one of `STALE_POLICIES`.
            hint: what to do when the workers lag, appended to the error.
        """
        self.oldest_allowed = oldest_allowed
        self.stale_policy = stale_policy
        self.hint = hint
        self.regenerated: set[Hashable] = set()  # the groups generated again in this step, by their key

    def must_regenerate(self, key: Hashable, result: GroupResult) -> bool:
        """Whether the completed group `key` is too old and must be generated again (then counted in `regenerated`).

        Raises:
            RolloutError: "stale", when it already was generated again in this step: the workers still serve older
                weights than the step needs.
        """
        if self.stale_policy != "regenerate" or oldest_version(result) >= self.oldest_allowed:
            return False
        if key in self.regenerated:
            raise RolloutError(
                "stale",
                f"a group generated again is still older than version {self.oldest_allowed} (the workers serve "
                f"version {oldest_version(result)}): the workers lag behind the pushes{self.hint}",
            )
        self.regenerated.add(key)
        return True
