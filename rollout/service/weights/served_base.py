"""What a worker calls the base weights it serves (`ServedBase`): the name the last whole update gave them, and other
names of the same weights, bit for bit. Two trainers of one checkpoint name their (equal) bases differently: the
second one's base is compared with the weights served when it arrives, found equal, and its name kept beside the
first, so neither trainer's later adapter pushes bring the base again, and no adapter served is disturbed."""

from __future__ import annotations

from rollout import protocol as p

MAX_BASE_ALIASES = 64  # other names kept (one per trainer of the same checkpoint; past it the oldest is forgotten)


class ServedBase:
    """The names of a worker's base weights (serving thread only)."""

    def __init__(self) -> None:
        self.base_id: str | None = None  # as the last whole update named them (None: loaded at start, or unnamed)
        self.aliases: list[str] = []  # other names of the same weights, newest last

    def names(self) -> frozenset[str | None]:
        """Every name the served weights go by (an adapter update naming one needs no base)."""
        return frozenset((self.base_id, *self.aliases))

    def set(self, base_id: str | None) -> None:
        """New base weights are served, named `base_id` (None: unnamed): the old ones' names are forgotten.

        Args:
            base_id: their name.
        """
        self.base_id, self.aliases = base_id, []

    def committed(self, begin: p.WeightsBegin, brings_base: bool, unchanged: bool) -> None:
        """Name the base once an update committed: a whole update's name, an adapter update's that brought other
        base weights, or one name more for the same weights (an adapter update that brought them unchanged).

        Args:
            begin: the update's weights_begin.
            brings_base: it brought base weights (a whole update always does).
            unchanged: those were the weights served, bit for bit (the engine compared them).
        """
        if begin.adapter is None or (brings_base and not unchanged):
            self.set(begin.base_id)
        elif brings_base and begin.base_id is not None and begin.base_id not in self.names():
            self.aliases = [*self.aliases, begin.base_id][-MAX_BASE_ALIASES:]
