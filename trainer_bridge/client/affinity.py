"""Prefix-affine routing for a client of several workers: a group whose prompt extends one the client sent recently
(an agent's next turn: the last prompt, its completion, a tool result) goes to the worker that served it, which
holds that prefix's KV, when that worker is not much busier than the least-loaded one; otherwise load decides.

The key is client-side: chained hashes of the prompt's full blocks of `AFFINITY_BLOCK` tokens (the workers' default
KV block size), longest match first; `PromptGroup(session_id=...)` replaces it with the session. A worker that is
dead or behind the newest weights is never chosen (the routing rule above this), and its sessions move with the
next group they send. Only the client's I/O thread uses this.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

AFFINITY_BLOCK = 16
CAPACITY = 1 << 16  # prefixes remembered (least recently used forgotten first)


class PrefixAffinity:
    """Which worker each recently sent prompt's prefixes went to."""

    def __init__(self, slack: float):
        """
        Args:
            slack: how much busier than the least-loaded worker the preferred one may be, in multiples of the
                group's own cost (its n x max_new_tokens), and still get it.
        """
        self.slack = slack
        self._workers: OrderedDict[Hashable, int] = OrderedDict()

    @staticmethod
    def keys(group: Any) -> list[Hashable]:
        """The group's affinity keys, shortest prefix first (its session alone when it names one)."""
        if getattr(group, "session_id", None) is not None:
            return [("session", group.session_id)]
        keys: list[Hashable] = []
        chained: Hashable = None
        prompt = group.prompt_ids
        for end in range(AFFINITY_BLOCK, len(prompt) + 1, AFFINITY_BLOCK):
            chained = hash((chained, tuple(prompt[end - AFFINITY_BLOCK : end])))
            keys.append(chained)
        return keys

    def choose(self, keys: Sequence[Hashable], current: list[int], load: Callable[[int], int], cost: int) -> int:
        """The worker for a group among `current` (alive, up to date): its longest known prefix's, when that worker
        is within the slack of the least-loaded; else the least-loaded."""
        least = min(current, key=load)
        for key in reversed(keys):
            worker = self._workers.get(key)
            if worker is None:
                continue
            self._workers.move_to_end(key)
            if worker in current and load(worker) <= load(least) + self.slack * cost:
                return worker
            break  # the longest known prefix's worker is gone or too busy: load decides
        return least

    def remember(self, keys: Sequence[Hashable], worker: int) -> None:
        """The group's prefixes are on `worker` now."""
        for key in keys:
            self._workers[key] = worker
            self._workers.move_to_end(key)
        while len(self._workers) > CAPACITY:
            self._workers.popitem(last=False)
