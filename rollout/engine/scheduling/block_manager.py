"""Ref-counted KV blocks with chained prefix hashes and copy-on-write.

Invariants:
- A block is in `free_blocks` exactly when its ref count is 0. Free blocks may still hold a cached prefix (their hash
  stays in `cached_blocks`) until they are handed out again, oldest-freed first (LRU).
- Only full blocks whose KV has been computed get a hash (`block_hash.py`: keyed, so no client can aim at another's
  prefix): hash(parent hash, the block's tokens, version), where the
  version is the oldest one behind the request's KV (`kv_version_min`), and lookups use the current version. So KV
  computed (even partly, across a "keep" update) under old weights never serves a request admitted after an update.
  A request's first block chains from its LoRA adapter's name (None for the base): adapters never share KV.
- Tokens are only ever written at positions >= num_computed_tokens, so a full computed (hashed) block is never
  written again; a shared partial block is copied before its first write (copy-on-write).
- A request whose logits turned non-finite is `quarantine`d: its blocks leave the prefix cache at once, and each is
  handed to the runner for zeroing (`take_stale`) when its last owner frees it, before anyone can take it again.
  With `zero_new_blocks` (PyTorch attention) every block `allocate` hands out is zeroed before its first write.
This module never imports torch: copies are returned as (src, dst) block pairs for the model runner to execute.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from rollout.engine.requests.request import Request
from rollout.engine.scheduling.block_hash import prefix_block_hash
from rollout.engine.scheduling.block_holders import BlockHolders


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)


def _first_parent(request: Request) -> tuple[str, str] | None:
    """What a request's first block hash chains from: its LoRA adapter (a prefix computed under one adapter is never
    reused by another, nor by the base), None for the base model."""
    return None if request.adapter is None else ("adapter", request.adapter.name)


class BlockManager:
    """Owns the device KV blocks (ref counts, prefix hashes) and the CPU swap blocks of one engine."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_swap_blocks: int = 0):
        """
        Args:
            num_blocks: device KV blocks.
            block_size: tokens per block.
            enable_prefix_caching: reuse full computed blocks across requests with the same prefix.
            num_swap_blocks: CPU blocks for swapping preempted requests (0 disables swapping).
        """
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.holders = BlockHolders(num_blocks)  # keeps each request's num_own_blocks (blocks with ref count 1)
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}
        self.num_prefix_tokens_hit = 0
        self.num_prefix_tokens_queried = 0
        self.num_swap_blocks = num_swap_blocks
        self.free_swap_blocks: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        # Bumped by the engine on every weight update; part of every prefix hash.
        self.policy_version = 0
        # The engine's MoE route cache (route_rows.RouteCache, or None): a request that wants routes takes a cached
        # block only when its routes are known.
        self.routed: Any = None
        self._tainted: set[int] = set()  # blocks of quarantined requests that some owner still holds
        self._stale: list[int] = []  # blocks to zero before their next write or read (`take_stale`)
        # Set by the engine when PyTorch attention serves it: that path reads whole blocks, so a sequence's own
        # blocks must hold zeros where it has not written yet (Triton's kernel never loads those slots).
        self.zero_new_blocks = False

    # ---- accounting -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Device blocks with ref count 0 (cached prefixes among them stay reusable until handed out)."""
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        """Device blocks held by at least one request."""
        return self.num_blocks - len(self.free_blocks)

    def can_allocate(self, num_blocks: int) -> bool:
        """True when `num_blocks` more blocks can be handed out now."""
        return num_blocks <= len(self.free_blocks)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `allocate(request, num_new_tokens)` would take, copy-on-write included."""
        start = request.num_computed_tokens
        needed = max(0, cdiv(start + num_new_tokens, self.block_size) - len(request.block_ids))
        return needed + int(self._needs_copy_on_write(request, start))

    def _needs_copy_on_write(self, request: Request, position: int) -> bool:
        index = position // self.block_size
        return index < len(request.block_ids) and self.ref_counts[request.block_ids[index]] > 1

    # ---- verbs ------------------------------------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]]:
        """Give `request` room to write its next `num_new_tokens` tokens.

        Args:
            request: the request; its `block_ids` grow in place.
            num_new_tokens: tokens it computes next, from position `num_computed_tokens`.
        Returns:
            (src, dst) block copies to execute before the write (copy-on-write of a shared partial block).
        Raises:
            RuntimeError: when there are not enough free blocks (callers check `blocks_needed` first).
        """
        if not self.can_allocate(self.blocks_needed(request, num_new_tokens)):
            raise RuntimeError(f"out of KV blocks for request {request.request_id}")
        copies = []
        start = request.num_computed_tokens
        num_blocks = len(request.block_ids)
        if self._needs_copy_on_write(request, start):
            index = start // self.block_size
            shared = request.block_ids[index]
            private = self._take_free_block(request)
            self.ref_counts[shared] -= 1  # > 0: another owner keeps it
            self.holders.remove(shared, request, self.ref_counts[shared])
            request.block_ids[index] = private
            copies.append((shared, private))
        while len(request.block_ids) * self.block_size < start + num_new_tokens:
            request.block_ids.append(self._take_free_block(request))
            if self.zero_new_blocks:
                self._stale.append(request.block_ids[-1])
        if copies or len(request.block_ids) != num_blocks:  # the runner rebuilds its block table only then
            request.blocks_version += 1
        return copies

    def fork(self, parent: Request, child: Request) -> None:
        """Make `child` share every block of `parent` (ref counts +1)."""
        child.block_ids = list(parent.block_ids)
        child.blocks_version += 1
        for block in child.block_ids:
            self.ref_counts[block] += 1
            self.holders.add(block, child, self.ref_counts[block])

    def free(self, request: Request) -> None:
        """Release the request's device blocks and swap blocks. Tail blocks become reusable before head blocks,
        so common prefixes stay cached longest."""
        self._release_device_blocks(request)
        self.free_swap_blocks.extend(request.swap_block_ids)
        request.swap_block_ids = []

    def _release_device_blocks(self, request: Request) -> None:
        ref_counts, sole = self.ref_counts, self.holders.sole
        for block in reversed(request.block_ids):
            ref_counts[block] -= 1
            if ref_counts[block] == 0:  # its own block (the common case, inlined: this loop runs for every block)
                sole[block] = None
                self.free_blocks[block] = None
                if self._tainted and block in self._tainted:
                    self._tainted.discard(block)
                    self._stale.append(block)
            else:
                self.holders.remove(block, request, ref_counts[block])
        request.num_own_blocks = 0  # each block was its own or shared; it holds none now
        request.block_ids = []
        request.blocks_version += 1

    def _take_free_block(self, request: Request) -> int:
        """Hand the oldest free block to `request` (its hash, if cached, is forgotten)."""
        block, _ = self.free_blocks.popitem(last=False)
        old_hash = self.block_hash[block]
        if old_hash is not None:
            if self.cached_blocks.get(old_hash) == block:
                del self.cached_blocks[old_hash]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        self.holders.add(block, request, 1)
        return block

    # ---- prefix caching ---------------------------------------------------------------------------------------
    def match_prefix(self, request: Request) -> tuple[list[int], list[int]]:
        """Find cached blocks for the leading full blocks of a request that holds no blocks.

        At most (num_tokens - 1) // block_size blocks match, so at least one token is left to compute (its logits
        are needed to sample) and a matched block is never written. A request that still wants prompt log-probs
        matches nothing: every prompt token must run through the model (as vLLM does for prompt_logprobs).
        Returns:
            (block ids, their hashes); nothing is taken until `take_prefix`.
        """
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return [], []
        wants_routes = request.routes is not None
        blocks: list[int] = []
        hashes: list[int] = []
        for block_hash in self._token_block_hashes(request, (request.num_tokens - 1) // self.block_size):
            block = self.cached_blocks.get(block_hash)
            if block is None or (wants_routes and (self.routed is None or not self.routed.knows(block_hash, block))):
                break
            blocks.append(block)
            hashes.append(block_hash)
        return blocks, hashes

    def _token_block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the request's first `num_blocks` full token blocks under the current version, memoised
        on the request: a request that waits for blocks is matched every step without rehashing its tokens."""
        version, hashes = request.prefix_hash_memo or (self.policy_version, [])
        if version != self.policy_version:
            hashes = []
        size = self.block_size
        while len(hashes) < num_blocks:
            index = len(hashes)
            parent = hashes[-1] if hashes else _first_parent(request)
            tokens = request.token_ids[index * size : (index + 1) * size]
            hashes.append(prefix_block_hash(parent, tokens, self.policy_version))
        request.prefix_hash_memo = (self.policy_version, hashes)
        return hashes[:num_blocks]

    def num_free_in(self, blocks: list[int]) -> int:
        """How many of `blocks` sit in the free pool (taking them lowers the free count)."""
        return sum(1 for block in blocks if self.ref_counts[block] == 0)

    def take_prefix(self, request: Request, blocks: list[int], hashes: list[int]) -> None:
        """Attach matched prefix blocks to `request` and mark their tokens computed."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
            self.holders.add(block, request, self.ref_counts[block])
        request.block_ids = list(blocks)
        request.blocks_version += 1
        request.block_hashes = list(hashes)
        request.num_computed_tokens = len(blocks) * self.block_size
        if request.cached_prompt_tokens is None:  # its first admission: the prompt tokens the cache spared it
            request.cached_prompt_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        if request.routes is not None:  # their MoE routes come from the route cache, also after a recompute
            request.routes.refill = request.num_computed_tokens
        # Prefix-cache statistics, counted once per admission: tokens found cached out of tokens to compute.
        self.num_prefix_tokens_hit += request.num_computed_tokens
        self.num_prefix_tokens_queried += request.num_tokens

    def commit_hashes(self, request: Request) -> None:
        """Hash the request's newly full, computed blocks and offer them for prefix reuse. Amortised O(1) per token:
        each block is hashed once."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        num_full = min(request.num_computed_tokens // size, len(request.block_ids))
        while len(request.block_hashes) < num_full:
            index = len(request.block_hashes)
            parent = request.block_hashes[-1] if request.block_hashes else _first_parent(request)
            # Keyed by the oldest version behind the request's KV, not the current one: a block finished after a
            # "keep" update holds KV partly computed under the old weights and must never match a lookup made
            # under the new version (lookups always use the current version, which only grows).
            version = self.policy_version if request.kv_version_min is None else request.kv_version_min
            block_hash = prefix_block_hash(parent, request.token_ids[index * size : (index + 1) * size], version)
            request.block_hashes.append(block_hash)
            block = request.block_ids[index]
            # (A quarantined block is never offered again: a fork that still holds it would hash it here, and once
            # freed it is zeroed while a lookup could still match it.)
            if self.block_hash[block] is not None or block in self._tainted:
                continue
            registered = self.cached_blocks.get(block_hash)
            if registered is not None and not self._routes_replace(request, block_hash, registered):
                continue
            if registered is not None:  # its owners keep it; it is no longer offered under the hash
                self.block_hash[registered] = None
            self.cached_blocks[block_hash] = block
            self.block_hash[block] = block_hash

    def _routes_replace(self, request: Request, block_hash: int, registered: int) -> bool:
        """Whether a block a routes-recording request computed takes the hash of the block registered under it,
        which has no kept routes (a request without `return_routes` computed it): else every later request for
        routes would compute that prefix again, as this one did, while the block stays cached."""
        return request.routes is not None and self.routed is not None and not self.routed.knows(block_hash, registered)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents), and the MoE routes kept for them: a
        prefix computed again lands under the same hash (same tokens, same version), perhaps in the same block, where
        the route cache would still lend the routes of the KV computed before the reset (other weights)."""
        self.cached_blocks.clear()
        self.block_hash = [None] * self.num_blocks
        if self.routed is not None:
            self.routed.clear()

    # ---- blocks whose KV went bad ----------------------------------------------------------------------------
    def quarantine(self, request: Request) -> None:
        """Keep a request's blocks out of the prefix cache from now on and have each zeroed when its last owner frees
        it: the request's logits turned non-finite, so its KV may hold NaN or Inf. Call it before freeing it."""
        for block in request.block_ids:
            block_hash = self.block_hash[block]
            if block_hash is not None:
                if self.cached_blocks.get(block_hash) == block:
                    del self.cached_blocks[block_hash]
                self.block_hash[block] = None
            self._tainted.add(block)

    def take_stale(self) -> list[int]:
        """Blocks to zero since the last call (quarantined blocks freed, and with `zero_new_blocks` the blocks
        `allocate` handed out): the runner zeroes them after the step's swap-outs and before anything else writes or
        reads them (`ScheduledBatch.zero_blocks`)."""
        stale, self._stale = self._stale, []
        return stale

    # ---- swapping ---------------------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        """True when there are enough free CPU swap blocks for all of the request's device blocks."""
        return 0 < len(request.block_ids) <= len(self.free_swap_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's KV to CPU swap blocks. Returns (device block, cpu block) copies to execute before any
        freed device block is written again."""
        cpu_blocks = [self.free_swap_blocks.pop() for _ in request.block_ids]
        copies = list(zip(request.block_ids, cpu_blocks))
        self._release_device_blocks(request)
        request.swap_block_ids = cpu_blocks
        return copies

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request's KV back into fresh device blocks. Returns (cpu block, device block) copies."""
        if not self.can_allocate(len(request.swap_block_ids)):
            raise RuntimeError(f"out of KV blocks to swap in request {request.request_id}")
        device_blocks = [self._take_free_block(request) for _ in request.swap_block_ids]
        copies = list(zip(request.swap_block_ids, device_blocks))
        self.free_swap_blocks.extend(request.swap_block_ids)
        request.swap_block_ids = []
        request.block_ids = device_blocks
        request.blocks_version += 1
        return copies

    def check_all_free(self) -> None:
        """Raise AssertionError unless every device and swap block is free (tests; `Engine.close` logs a leak)."""
        leaked = [block for block, count in enumerate(self.ref_counts) if count != 0]
        assert not leaked and len(self.free_blocks) == self.num_blocks, f"leaked KV blocks: {leaked[:16]}"
        assert len(self.free_swap_blocks) == self.num_swap_blocks, "leaked swap blocks"
        self.holders.check_empty()
