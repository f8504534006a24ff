"""The MoE routes one sample recorded (`SamplingParams.return_routes`): per sequence position the forward computed,
the expert ids each MoE layer's router chose for it, (MoE layers, top_k) integers in the router's own order.

Positions 0 .. prompt_len - 1 are the prompt's forward, computed once per group by its leader and shared with the
samples forked from it (a sample's first token is drawn from the logits at position prompt_len - 1, so that row
is the first of its `routes`); later positions are the sample's own. A sample that computes shared positions again
(a recompute after preemption) takes its own copy first: each sample's routes are those of the KV it used.
A full KV block's routes are also kept by its prefix hash (`RouteCache`): a request that takes cached blocks gets
the routes they were computed with, as it gets their KV. This module never imports torch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

ROUTE_DTYPE = np.int16  # expert ids: up to 32767 experts per layer


class PositionRoutes:
    """Routes of a run of positions starting at `first`, grown as chunks arrive."""

    def __init__(self, first: int, owner: object):
        self.first = first
        self.owner = owner  # the request that may write here (others copy first)
        self.rows = np.zeros((0, 0, 0), dtype=ROUTE_DTYPE)
        self.known = 0  # positions first .. first + known - 1 hold routes
        self.shared = False  # forked samples read it too

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
        self.offered = 0  # full blocks whose routes went to the RouteCache
        self.refill = 0  # positions 0 .. refill - 1 come from cached blocks taken at the last admission

    def known_upto(self) -> int:
        """How many positions from 0 on have routes."""
        if self.prompt.known < self.num_prompt_tokens:
            return self.prompt.known
        return self.num_prompt_tokens + self.own.known

    def positions(self, start: int, end: int) -> np.ndarray | None:
        """Routes of positions start .. end - 1 (a copy), or None when one is unknown."""
        pieces = []
        for part, last in ((self.prompt, self.num_prompt_tokens), (self.own, None)):
            low, high = max(start, part.first), min(end, last if last is not None else end)
            if low >= high:
                continue
            if part.known < high - part.first:
                return None
            pieces.append(part.rows[low - part.first : high - part.first])
        return np.concatenate(pieces).copy() if pieces else None

    def forked(self, owner: object) -> RouteRows:
        """The routes of a sample forked from this one: the same prompt positions (shared), nothing of its own."""
        self.prompt.shared = True
        return RouteRows(self.num_prompt_tokens, owner, self.prompt)

    def write(self, position: int, rows: np.ndarray) -> None:
        """Routes of positions position .. position + len(rows) - 1, computed by this sample's forward."""
        split = max(0, min(len(rows), self.num_prompt_tokens - position))
        if split:
            # Shared with forks and already known there: a recompute (by anyone, the leader too) rewrites its own
            # copy; the others keep the routes of the KV they used.
            if self.prompt.owner is not self._owner or (self.prompt.shared and position < self.prompt.known):
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


class RouteCache:
    """Routes of full KV blocks by prefix hash, with the block they were recorded in: the most recent `capacity` of
    them (the prefix cache holds at most the KV cache's blocks, so a capacity above that keeps every block still
    matchable). Only the block whose KV was computed with them matches: the same tokens computed again elsewhere
    (in bf16, perhaps routed otherwise) do not lend their routes to it."""

    def __init__(self, block_size: int, capacity: int):
        self.block_size = block_size
        self.capacity = capacity
        self._rows: OrderedDict[int, tuple[int, np.ndarray]] = OrderedDict()

    def knows(self, block_hash: int, block: int) -> bool:
        """Whether the routes of cached `block` (under `block_hash`) are kept (a lookup counts as a use)."""
        entry = self._rows.get(block_hash)
        if entry is None or entry[0] != block:
            return False
        self._rows.move_to_end(block_hash)
        return True

    def __len__(self) -> int:
        return len(self._rows)

    def clear(self) -> None:
        """Forget every block's routes (the prefix cache was reset: `BlockManager.reset_prefix_cache`)."""
        self._rows.clear()

    def fill(self, request: Any, end: int) -> None:
        """Give a request that took cached blocks the routes of positions 0 .. end - 1 from them (block-aligned)."""
        size = self.block_size
        for block in range(end // size):
            entry = self._rows.get(request.block_hashes[block]) if block < len(request.block_hashes) else None
            if entry is None or block >= len(request.block_ids) or entry[0] != request.block_ids[block]:
                return  # evicted or replaced meanwhile: those positions stay unknown (outputs carry no routes)
            request.routes.write(block * size, entry[1])

    def keep(self, request: Any, cached_blocks: dict[int, int]) -> None:
        """Keep the routes of the request's full blocks that have a hash and known routes (each block once), for
        the blocks the prefix cache holds under that hash (`cached_blocks`: hash -> block, the block manager's)."""
        routes, size = request.routes, self.block_size
        if routes.offered > len(request.block_hashes):  # recomputed since: its blocks are hashed again
            routes.offered = 0
        while routes.offered < min(len(request.block_hashes), len(request.block_ids)):  # swapped out: none
            block = routes.offered
            rows = routes.positions(block * size, (block + 1) * size)
            if rows is None:
                return
            block_hash, block_id = request.block_hashes[block], request.block_ids[block]
            entry = self._rows.get(block_hash)
            registered = cached_blocks.get(block_hash) == block_id  # the block a lookup would take
            if registered and (entry is None or entry[0] != block_id):  # new, or a block recycled since
                self._rows[block_hash] = (block_id, rows)
                self._rows.move_to_end(block_hash)
                if len(self._rows) > self.capacity:
                    self._rows.popitem(last=False)
            routes.offered += 1
