"""The MoE routes one sample recorded (`SamplingParams.return_routes`): per sequence position the forward computed,
the expert ids each MoE layer's router chose for it, (MoE layers, top_k) integers in the router's own order.

Positions 0 .. prompt_len - 1 are the prompt's forward, computed once per group by its leader and shared with the
samples forked from it (a sample's first token is drawn from the logits at position prompt_len - 1, so that row
is the first of its `routes`); later positions are the sample's own. A sample that computes shared positions again
(a recompute after preemption) takes its own copy first: each sample's routes are those of the KV it used.
This module never imports torch.
"""

from __future__ import annotations

import numpy as np

ROUTE_DTYPE = np.int16  # expert ids: up to 32767 experts per layer


class PositionRoutes:
    """Routes of a run of positions starting at `first`, grown as chunks arrive."""

    def __init__(self, first: int, owner: object):
        self.first = first
        self.owner = owner  # the request that may write here (others copy first)
        self.rows = np.zeros((0, 0, 0), dtype=ROUTE_DTYPE)
        self.known = 0  # positions first .. first + known - 1 hold routes

    def write(self, position: int, rows: np.ndarray) -> None:
        """Routes of positions position .. position + len(rows) - 1 (rows: (n, layers, top_k))."""
        start = position - self.first
        end = start + len(rows)
        if self.rows.shape[1:] != rows.shape[1:]:
            self.rows = np.zeros((max(end, 16), *rows.shape[1:]), dtype=ROUTE_DTYPE)
        elif end > len(self.rows):
            grown = np.zeros((max(end, 2 * len(self.rows)), *rows.shape[1:]), dtype=ROUTE_DTYPE)
            grown[: len(self.rows)] = self.rows
            self.rows = grown
        self.rows[start:end] = rows
        if start <= self.known:  # a gap (a chunk whose routes never arrived) stays unknown
            self.known = max(self.known, end)

    def copy(self, owner: object) -> PositionRoutes:
        """An independent copy owned by `owner`."""
        copied = PositionRoutes(self.first, owner)
        copied.rows, copied.known = self.rows.copy(), self.known
        return copied


class RouteRows:
    """One sample's routes: the prompt's positions (shared with its group) and its own later ones."""

    def __init__(self, num_prompt_tokens: int, owner: object, prompt: PositionRoutes | None = None):
        self.num_prompt_tokens = num_prompt_tokens
        self.prompt = prompt if prompt is not None else PositionRoutes(0, owner)
        self.own = PositionRoutes(num_prompt_tokens, owner)
        self._owner = owner

    def forked(self, owner: object) -> RouteRows:
        """The routes of a sample forked from this one: the same prompt positions (shared), nothing of its own."""
        return RouteRows(self.num_prompt_tokens, owner, self.prompt)

    def write(self, position: int, rows: np.ndarray) -> None:
        """Routes of positions position .. position + len(rows) - 1, computed by this sample's forward."""
        split = max(0, min(len(rows), self.num_prompt_tokens - position))
        if split:
            if self.prompt.owner is not self._owner:  # recomputing shared positions: a copy of its own
                self.prompt = self.prompt.copy(self._owner)
            self.prompt.write(position, rows[:split])
        if split < len(rows):
            self.own.write(position + split, rows[split:])

    def prompt_routes(self) -> np.ndarray | None:
        """(prompt_len - 1, layers, top_k): the routing of every prompt position before the last; None until known."""
        count = self.num_prompt_tokens - 1
        if self.prompt.known < count:
            return None
        return self.prompt.rows[:count].copy()

    def generated_routes(self, start: int, end: int) -> np.ndarray | None:
        """(end - start, layers, top_k): row i the forward that sampled generated token start + i (position
        prompt_len - 1 + start + i); None when a row is unknown."""
        if start >= end or self.own.known < end - 1:  # own row j: position prompt_len + j, token j + 1
            return None
        pieces = [self.own.rows[max(0, start - 1) : end - 1]] if end > 1 else []
        if start == 0:  # token 0: the prompt's last position
            if self.prompt.known < self.num_prompt_tokens:
                return None
            last = self.num_prompt_tokens - 1
            pieces.insert(0, self.prompt.rows[last : last + 1])
        return np.concatenate(pieces).copy()
