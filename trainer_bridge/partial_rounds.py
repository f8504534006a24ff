"""Partial rollouts (APRIL, slime): a training round takes the first complete groups, not the slowest ones.

More groups are kept in flight than a round trains on (`overprovision`: extra groups as a fraction of a round's). A
round ends as soon as enough groups are complete: the oldest complete ones first, and every group that has already
spanned `max_partial_rounds` rounds (they are waited for, so no sample spans more). The others keep generating on
the workers, their KV kept across weight updates (push mode "keep") and every token tagged with the weights' version,
and join a later round. After a round, at most `ceil(overprovision * groups_per_round)` groups are left over, so the
groups a round must wait for never outnumber it.

Rounds spanned by a group: the round that trains it minus the round it was sent in, plus one. Its first tokens are
then `max_partial_rounds - 1` rounds older than the weights the round trains; whoever sizes staleness (AsyncRollouts'
and the TRL trainer's `max_staleness`) refuses a bound that does not cover that (`check_partial`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_PARTIAL_ROUNDS = 2
DEFAULT_OVERPROVISION = 0.5


def check_partial(
    partial_rollouts: Any, max_partial_rounds: Any, overprovision: Any, max_staleness: int, rounds_per_staleness: float
) -> None:
    """Refuse, by name, partial-rollout settings that are malformed or conflict with the staleness bound.

    Args:
        partial_rollouts: the flag (must be a bool).
        max_partial_rounds: rounds a group may span (None: the default; only with partial_rollouts).
        overprovision: extra groups in flight (None: the default; only with partial_rollouts).
        max_staleness: the staleness bound, in optimizer steps.
        rounds_per_staleness: optimizer steps one round spans (1 for a plain loop).
    Raises:
        ValueError: naming the setting.
    """
    if not isinstance(partial_rollouts, bool):
        raise ValueError(f"partial_rollouts must be True or False, got {partial_rollouts!r}")
    if not partial_rollouts:
        for name, value in (("max_partial_rounds", max_partial_rounds), ("partial_overprovision", overprovision)):
            if value is not None:
                raise ValueError(f"{name} has no effect without partial_rollouts=True")
        return
    rounds = DEFAULT_MAX_PARTIAL_ROUNDS if max_partial_rounds is None else max_partial_rounds
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 2:
        raise ValueError(
            f"max_partial_rounds must be an integer >= 2, got {max_partial_rounds!r} (1 would wait for every group in "
            "flight each round: use partial_rollouts=False)"
        )
    extra = DEFAULT_OVERPROVISION if overprovision is None else overprovision
    if isinstance(extra, bool) or not isinstance(extra, (int, float)) or not 0 < extra <= 1:
        raise ValueError(f"partial_overprovision must be a number in (0, 1], got {overprovision!r}")
    lag = (rounds - 1) * rounds_per_staleness
    if lag > max_staleness:
        raise ValueError(
            f"max_partial_rounds={rounds} lets a sample's first tokens be {lag:g} optimizer steps older than the "
            f"weights it is trained at, beyond max_staleness={max_staleness}: raise max_staleness to {math.ceil(lag)} "
            "or lower max_partial_rounds"
        )


@dataclass
class _Entry:
    round_sent: int
    order: int  # when it was added: older first
    result: Any = None


@dataclass
class PartialRounds:
    """The groups in flight and which of them a round takes; the caller sends, collects and trains.

    Attributes:
        groups_per_round: groups a round trains on.
        max_partial_rounds: most rounds one group may span.
        overprovision: extra groups kept in flight, as a fraction of groups_per_round.
    """

    groups_per_round: int
    max_partial_rounds: int = DEFAULT_MAX_PARTIAL_ROUNDS
    overprovision: float = DEFAULT_OVERPROVISION
    _entries: dict[Hashable, _Entry] = field(default_factory=dict)
    _added: int = 0

    @property
    def capacity(self) -> int:
        """Groups kept in flight at the start of a round."""
        return self.groups_per_round + math.ceil(self.overprovision * self.groups_per_round)

    @property
    def room(self) -> int:
        """How many more groups to send now."""
        return max(0, self.capacity - len(self._entries))

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: Hashable, round_sent: int) -> None:
        """A group was sent in round `round_sent`."""
        self._entries[key] = _Entry(round_sent, self._added)
        self._added += 1

    def complete(self, key: Hashable, result: Any) -> None:
        """A group's result arrived (ignored for a key not in flight: taken or dropped already)."""
        if key in self._entries:
            self._entries[key].result = result

    def resent(self, key: Hashable, round_sent: int) -> None:
        """A group was sent again (aborted or too stale): it starts over in round `round_sent`."""
        entry = self._entries[key]
        entry.round_sent, entry.result = round_sent, None

    def take(self, round_now: int) -> list[tuple[Hashable, Any, int]] | None:
        """The groups round `round_now` trains on, removed from the pool, oldest first: every group that spanned
        `max_partial_rounds` rounds and the oldest other complete ones, `groups_per_round` in all (fewer when fewer
        are in flight and all are complete), as (key, result, round sent). None while that is not possible yet: wait
        for more results."""
        entries = sorted(self._entries.items(), key=lambda item: item[1].order)
        due = [key for key, e in entries if round_now - e.round_sent + 1 >= self.max_partial_rounds]
        if any(self._entries[key].result is None for key in due):
            return None
        wanted = min(self.groups_per_round, len(entries))
        due_set = set(due)
        ready = due + [key for key, e in entries if e.result is not None and key not in due_set]
        if len(ready) < wanted:
            return None
        chosen = ready[:wanted]
        taken = [(key, self._entries.pop(key)) for key in chosen]
        return [(key, entry.result, entry.round_sent) for key, entry in taken]

    def completed(self) -> list[tuple[Hashable, Any]]:
        """(key, result) of the complete groups still in the pool."""
        return [(key, e.result) for key, e in self._entries.items() if e.result is not None]

    def round_sent(self, key: Hashable) -> int:
        """The round a group in flight was (last) sent in."""
        return self._entries[key].round_sent
