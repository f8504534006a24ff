"""BlockManager unit tests: ref counts, fork and copy-on-write, prefix hashes, LRU reuse, swapping. No model."""

from __future__ import annotations

import pytest

from conftest import make_request
from rollout.engine.requests.request import Request
from rollout.engine.scheduling.block_manager import BlockManager

BS = 4  # tokens per block in every test


def computed(manager: BlockManager, tokens: list[int], num_computed: int | None = None) -> Request:
    """A request holding blocks for all `tokens`, the first `num_computed` (default all) computed and hashed."""
    request = make_request("r", tokens)
    manager.allocate(request, len(tokens))
    request.num_computed_tokens = len(tokens) if num_computed is None else num_computed
    manager.commit_hashes(request)
    return request


def test_allocate_grows_block_table_to_cover_tokens():
    """allocate() adds blocks only when the next tokens cross a block boundary; each new block has ref count 1."""
    manager = BlockManager(8, BS)
    request = make_request("r", list(range(5)))
    assert manager.blocks_needed(request, 5) == 2
    assert manager.allocate(request, 5) == []
    assert len(request.block_ids) == 2 and [manager.ref_counts[b] for b in request.block_ids] == [1, 1]

    request.num_computed_tokens = 5
    request.token_ids += [5, 6, 7]
    assert manager.blocks_needed(request, 3) == 0  # positions 5..7 still fit in block 1
    manager.allocate(request, 3)
    assert len(request.block_ids) == 2

    request.num_computed_tokens = 8
    request.token_ids.append(8)
    assert manager.blocks_needed(request, 1) == 1
    manager.allocate(request, 1)
    assert len(request.block_ids) == 3 and len(set(request.block_ids)) == 3
    assert (manager.num_used_blocks, manager.num_free_blocks) == (3, 5)


def test_allocate_out_of_blocks_raises_and_takes_nothing():
    """A request that needs more blocks than are free is refused as a whole (no partial allocation)."""
    manager = BlockManager(2, BS)
    request = make_request("r", list(range(12)))
    assert manager.blocks_needed(request, 12) == 3 and not manager.can_allocate(3)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        manager.allocate(request, 12)
    assert request.block_ids == [] and manager.num_free_blocks == 2


def test_fork_shares_every_block():
    """fork() gives the child the parent's block table and raises every ref count to 2 without taking blocks."""
    manager = BlockManager(8, BS)
    parent = computed(manager, list(range(6)))
    child = parent.fork(1, "r#1", arrival=1)
    manager.fork(parent, child)
    assert child.block_ids == parent.block_ids
    assert [manager.ref_counts[b] for b in parent.block_ids] == [2, 2]
    assert manager.num_used_blocks == 2


def test_copy_on_write_of_shared_partial_block():
    """After a fork at 6 tokens, the first writer of the shared partial block gets a private copy (src, dst);
    the last owner writes in place; the full block stays shared."""
    manager = BlockManager(8, BS)
    parent = computed(manager, list(range(6)))
    full, partial = parent.block_ids
    child = parent.fork(1, "r#1", arrival=1)
    manager.fork(parent, child)

    parent.token_ids.append(100)
    assert manager.blocks_needed(parent, 1) == 1  # the copy-on-write block
    copies = manager.allocate(parent, 1)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == partial and dst not in (full, partial)
    assert parent.block_ids == [full, dst] and child.block_ids == [full, partial]
    assert (manager.ref_counts[full], manager.ref_counts[partial], manager.ref_counts[dst]) == (2, 1, 1)

    child.token_ids.append(200)
    assert manager.blocks_needed(child, 1) == 0
    assert manager.allocate(child, 1) == []  # sole owner now: no copy
    assert child.block_ids == [full, partial]
    assert manager.num_used_blocks == 3


def test_fork_at_block_boundary_needs_no_copy():
    """When the prompt ends on a block boundary, the next token goes to a new private block: nothing is copied and
    the full blocks stay shared by both samples."""
    manager = BlockManager(8, BS)
    parent = computed(manager, list(range(8)))
    child = parent.fork(1, "r#1", arrival=1)
    manager.fork(parent, child)
    for request in (parent, child):
        request.token_ids.append(9)
        assert manager.allocate(request, 1) == []
    assert parent.block_ids[:2] == child.block_ids[:2] and parent.block_ids[2] != child.block_ids[2]
    assert [manager.ref_counts[b] for b in parent.block_ids] == [2, 2, 1]


def test_free_returns_blocks_and_check_all_free_detects_leak():
    """Blocks come back only when their last owner frees them; check_all_free raises while any block is held."""
    manager = BlockManager(8, BS)
    parent = computed(manager, list(range(6)))
    child = parent.fork(1, "r#1", arrival=1)
    manager.fork(parent, child)
    manager.free(parent)
    assert parent.block_ids == [] and manager.num_used_blocks == 2  # still held by the child
    with pytest.raises(AssertionError, match="leaked KV blocks"):
        manager.check_all_free()
    manager.free(child)
    assert manager.num_free_blocks == 8
    manager.check_all_free()


def test_prefix_match_finds_full_computed_blocks():
    """An identical prefix matches the cached full blocks; take_prefix shares them and marks their tokens computed.
    At most (num_tokens - 1) // block_size blocks match, so the last token is always computed."""
    manager = BlockManager(16, BS)
    tokens = list(range(10))
    first = computed(manager, tokens)
    assert len(first.block_hashes) == 2  # the partial third block is not hashed

    second = make_request("s", tokens)
    blocks, hashes = manager.match_prefix(second)
    assert blocks == first.block_ids[:2] and hashes == first.block_hashes
    manager.take_prefix(second, blocks, hashes)
    assert second.num_computed_tokens == 8 and second.block_ids == first.block_ids[:2]
    assert [manager.ref_counts[b] for b in blocks] == [2, 2]

    assert len(manager.match_prefix(make_request("t", tokens[:8]))[0]) == 1  # (8 - 1) // 4
    assert len(manager.match_prefix(make_request("u", tokens[:9]))[0]) == 2  # (9 - 1) // 4
    assert manager.match_prefix(make_request("v", tokens[:4]))[0] == []  # (4 - 1) // 4
    manager.free(first)
    manager.free(second)
    manager.check_all_free()


def test_prefix_match_ignores_uncomputed_blocks():
    """Only blocks whose KV has been computed get a hash: a full but not yet computed block never matches."""
    manager = BlockManager(16, BS)
    tokens = list(range(10))
    first = computed(manager, tokens, num_computed=6)
    assert len(first.block_hashes) == 1
    assert len(manager.match_prefix(make_request("s", tokens))[0]) == 1


def test_prefix_hash_is_chained():
    """A block matches only if every block before it matches too (the hash includes the parent's hash)."""
    manager = BlockManager(16, BS)
    computed(manager, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert manager.match_prefix(make_request("s", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == ([], [])
    assert len(manager.match_prefix(make_request("t", [1, 2, 3, 4, 0, 6, 7, 8, 9]))[0]) == 1


def test_policy_version_keys_prefix_hashes():
    """After a weight update (policy_version bump) the same tokens do not match KV computed under old weights;
    blocks computed under the new version match again."""
    manager = BlockManager(16, BS)
    tokens = list(range(10))
    old = computed(manager, tokens)
    manager.policy_version += 1
    assert manager.match_prefix(make_request("s", tokens)) == ([], [])

    new = computed(manager, tokens)
    blocks, _ = manager.match_prefix(make_request("t", tokens))
    assert blocks == new.block_ids[:2] and not set(blocks) & set(old.block_ids)
    manager.policy_version -= 1
    assert manager.match_prefix(make_request("u", tokens))[0] == old.block_ids[:2]


def test_freed_cached_blocks_are_reused_tail_first_and_lose_their_hash():
    """Freed blocks keep their prefix until handed out again, oldest-freed first; a request's tail block is freed
    before its head, so the head (the shared prefix) survives longest. A reused block's hash is dropped."""
    manager = BlockManager(4, BS)
    tokens = list(range(9))
    first = computed(manager, tokens[:8])
    head, tail = first.block_ids
    manager.free(first)

    other = make_request("o", list(range(100, 112)))
    manager.allocate(other, 12)  # the 2 never-used blocks, then the freed tail
    assert tail in other.block_ids and head not in other.block_ids
    assert manager.block_hash[tail] is None and manager.block_hash[head] is not None
    assert manager.match_prefix(make_request("s", tokens))[0] == [head]

    manager.free(other)
    manager.check_all_free()


def test_take_prefix_revives_a_free_cached_block():
    """A matched block sitting in the free pool leaves it (ref count 0 -> 1) when taken."""
    manager = BlockManager(8, BS)
    tokens = list(range(9))
    first = computed(manager, tokens)
    manager.free(first)
    assert manager.num_free_blocks == 8

    second = make_request("s", tokens)
    blocks, hashes = manager.match_prefix(second)
    assert manager.num_free_in(blocks) == 2
    manager.take_prefix(second, blocks, hashes)
    assert manager.num_free_blocks == 6 and [manager.ref_counts[b] for b in blocks] == [1, 1]
    manager.free(second)
    manager.check_all_free()


def test_prefix_caching_disabled_never_matches():
    """With prefix caching off, identical prompts share nothing."""
    manager = BlockManager(8, BS, enable_prefix_caching=False)
    tokens = list(range(9))
    computed(manager, tokens)
    assert manager.match_prefix(make_request("s", tokens)) == ([], [])


def test_swap_out_and_swap_in():
    """swap_out copies each device block to its own CPU block and frees the device blocks; swap_in takes fresh
    device blocks and pairs them with the same CPU blocks, which become free again."""
    manager = BlockManager(8, BS, num_swap_blocks=4)
    request = computed(manager, list(range(10)))
    device = list(request.block_ids)
    assert manager.can_swap_out(request)

    out = manager.swap_out(request)
    assert [d for d, _ in out] == device and len({c for _, c in out}) == 3
    assert request.block_ids == [] and request.swap_block_ids == [c for _, c in out]
    assert manager.num_free_blocks == 8 and len(manager.free_swap_blocks) == 1
    with pytest.raises(AssertionError, match="leaked swap blocks"):
        manager.check_all_free()

    second = computed(manager, list(range(10)))  # 3 blocks, but only 1 swap block left
    assert not manager.can_swap_out(second)
    blocker = make_request("b", list(range(16)))
    manager.allocate(blocker, 16)  # 7 of 8 device blocks now held
    with pytest.raises(RuntimeError, match="swap in"):
        manager.swap_in(request)
    manager.free(blocker)

    back = manager.swap_in(request)
    assert [c for c, _ in back] == [c for _, c in out]
    assert request.block_ids == [d for _, d in back] and request.swap_block_ids == []
    assert len(manager.free_swap_blocks) == 4
    assert [manager.ref_counts[b] for b in request.block_ids] == [1, 1, 1]
    manager.free(request)
    manager.free(second)
    manager.check_all_free()


@pytest.mark.parametrize("seed", range(4))
def test_own_block_counts_stay_exact_through_random_operations(seed):
    """`Request.num_own_blocks` (what admission with known lengths reads) equals the blocks with ref count 1 in the
    request's table after every operation: prefix reuse of another's blocks, forks, copy-on-write of a shared partial
    block, frees that leave a block to one holder, swapping out and in. Checked against the ref counts themselves."""
    import random

    rng = random.Random(seed)
    manager = BlockManager(48, BS, num_swap_blocks=24)
    live: list[Request] = []
    swapped: list[Request] = []

    def check() -> None:
        for request in live:
            alone = sum(manager.ref_counts[b] == 1 for b in request.block_ids)
            assert request.num_own_blocks == alone, (request.request_id, request.num_own_blocks, alone)
        assert all(r.num_own_blocks == 0 for r in swapped)

    for step in range(600):
        op = rng.random()
        if op < 0.25 or not live:  # admit: prompts from a small vocabulary, so prefixes repeat
            request = make_request(f"r{step}", [rng.randrange(2) for _ in range(rng.randint(1, 14))])
            blocks, hashes = manager.match_prefix(request)
            if not manager.can_allocate(manager.num_free_in(blocks) + len(request.token_ids) // BS + 1):
                continue
            manager.take_prefix(request, blocks, hashes)
            manager.allocate(request, request.num_tokens - request.num_computed_tokens)
            request.num_computed_tokens = request.num_tokens
            manager.commit_hashes(request)
            live.append(request)
        elif op < 0.6:  # decode a token (a fork's first write copies the partial block it shares)
            request = rng.choice(live)
            request.token_ids.append(rng.randrange(2))
            if not manager.can_allocate(manager.blocks_needed(request, 1)):
                request.token_ids.pop()
                continue
            manager.allocate(request, 1)
            request.num_computed_tokens += 1
            manager.commit_hashes(request)
        elif op < 0.72:
            parent = rng.choice(live)
            child = parent.fork(1, f"{parent.request_id}#{step}", arrival=step)
            manager.fork(parent, child)
            live.append(child)
        elif op < 0.9:
            request = live.pop(rng.randrange(len(live)))
            manager.free(request)
            assert request.num_own_blocks == 0
        elif op < 0.95 and live:
            request = rng.choice(live)
            if manager.can_swap_out(request):
                manager.swap_out(request)
                live.remove(request)
                swapped.append(request)
        elif swapped and manager.can_allocate(len(swapped[0].swap_block_ids)):
            request = swapped.pop(0)
            manager.swap_in(request)
            live.append(request)
        check()
    for request in live + swapped:
        manager.free(request)
    manager.check_all_free()


def test_a_quarantined_block_a_fork_still_holds_is_never_offered_to_the_prefix_cache_again():
    """A leader's KV quarantined (its logits went non-finite) while its fork, forked at schedule time, has not hashed
    their shared prompt block yet: the fork's first decode must not offer that block to the prefix cache again, since
    once freed it is zeroed, and a later request with the same prompt would read zeros as its prefix."""
    manager = BlockManager(16, 4)
    leader = make_request("g", list(range(10, 17)), n=2)  # 7 prompt tokens: block 0 full
    manager.allocate(leader, 7)
    leader.num_computed_tokens = 7
    child = leader.fork(1, "g#1", 1)
    manager.fork(leader, child)
    leader.kv_version_min = child.kv_version_min = 0
    manager.commit_hashes(leader)
    manager.quarantine(leader)
    manager.free(leader)
    child.token_ids.append(99)
    child.num_computed_tokens = 8
    manager.allocate(child, 1)
    manager.commit_hashes(child)
    shared = child.block_ids[0]
    assert manager.cached_blocks.get(child.block_hashes[0]) != shared
    manager.free(child)
    assert shared in manager.take_stale()  # zeroed before anything reads it
    blocks, _ = manager.match_prefix(make_request("h", list(range(10, 17)) + [1]))
    assert blocks == []
    manager.check_all_free()


def test_prefix_hashes_are_keyed_by_the_process_secret():
    """A block's prefix hash depends on the process's secret hash key (PYTHONHASHSEED, random by default): a hit
    compares only hashes, so hashes anyone could compute off-line would let a client craft a block that collides
    with another client's prefix and have its KV serve that client. The same process hashes alike (the cache
    works); two keys hash the same blocks apart."""
    import os
    import subprocess
    import sys

    script = (
        "from rollout.engine.requests.request import Request\n"
        "from rollout.engine.scheduling.block_manager import BlockManager\n"
        "from rollout.sampling_params import SamplingParams\n"
        "for adapter in (None, 'a'):\n"
        "    manager = BlockManager(8, 4)\n"
        "    request = Request('r', 'r', 0, list(range(100, 112)), 12, SamplingParams(), 8, frozenset(), 0, 0)\n"
        "    if adapter:\n"
        "        request.adapter = type('Adapter', (), {'name': adapter})()\n"
        "    manager.allocate(request, 12)\n"
        "    request.num_computed_tokens = 12\n"
        "    manager.commit_hashes(request)\n"
        "    print(request.block_hashes)\n"
    )

    def hashes(seed: str) -> str:
        environment = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    first = hashes("1")
    assert first == hashes("1") and len(set(first.split())) == 6
    second = hashes("2")
    for line_one, line_two in zip(first.splitlines(), second.splitlines(), strict=True):
        assert set(line_one.strip("[]").split(", ")).isdisjoint(line_two.strip("[]").split(", "))
