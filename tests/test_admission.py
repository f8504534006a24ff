"""Admission and preemption under memory pressure (`rollout.engine.scheduling.admission`): the growth reserve, the
victim that loses the fewest tokens, and requests with the same prompt waiting for one of them to compute it."""

from __future__ import annotations

import pytest
from test_scheduler import TOKEN, Sim, prompt, sim

from conftest import make_request, make_scheduler
from rollout.engine.scheduling.admission import GrowthReserve, cheapest_victim
from rollout.engine.scheduling.batch import ScheduledBatch, ScheduledSequence
from rollout.engine.scheduling.block_manager import BlockManager
from rollout.engine.scheduling.future_peak import lifetime, peak_growth


def test_growth_ratio_decays_with_turnover_and_rises_on_preemption():
    growth = GrowthReserve(block_size=4, clip_tokens=400, initial_ratio=0.5, floor_ratio=0.05)
    request = make_request("r", prompt(8), max_new_tokens=1000)
    assert growth.blocks(request) == 400 * 0.5 / 4  # clipped at 400 tokens, half of them expected
    assert growth.blocks(make_request("g", prompt(8), max_new_tokens=1000, n=3)) == 3 * 50  # a leader forks 2 more
    for _ in range(200):
        growth.step()
    assert 0.05 < growth.ratio < 0.5  # before any request finished, it decays over clip_tokens steps
    growth.finished(40, 1000)
    for _ in range(40):
        growth.step()
    assert growth.ratio == 0.05  # then over the mean finished length
    growth.preempted()
    assert growth.ratio == 0.5
    growth.preempted()
    growth.preempted()
    assert growth.ratio == 1.0


def test_lengths_count_as_known_while_half_the_recently_finished_requests_used_all_of_max_new_tokens():
    growth = GrowthReserve(block_size=4)
    assert not growth.lengths_known  # nothing finished yet
    growth.finished(30, 100)  # a stop token
    assert not growth.lengths_known
    growth.finished(100, 100)
    assert growth.lengths_known
    growth.finished(12, 100)
    assert not growth.lengths_known
    for _ in range(growth.recent_window // 2):  # the last 64 decide: the first two fall out of the window
        growth.finished(100, 100)
        growth.finished(7, 100)
    assert growth.lengths_known
    growth.finished(7, 100)
    assert not growth.lengths_known
    for _ in range(growth.recent_window):  # a probe (one token) says nothing
        growth.finished(1, 1)
    assert not growth.lengths_known


def test_the_ratio_starts_again_when_lengths_stop_being_known():
    growth = GrowthReserve(block_size=4, initial_ratio=0.5, floor_ratio=0.05)
    growth.finished(100, 100)
    for _ in range(1000):
        growth.step()
    assert growth.lengths_known and growth.ratio == 0.05  # the ratio decayed, unused
    growth.finished(10, 100)
    growth.finished(10, 100)
    assert not growth.lengths_known and growth.ratio == 0.5


@pytest.mark.parametrize("max_batch_tokens", [512, 40])
def test_peak_growth_bounds_the_blocks_the_block_manager_hands_out(max_batch_tokens):
    """Requests of known lengths (a group of 3 forked from one leader shares its prompt's blocks) run to their
    max_new_tokens on the real block manager, admitting no more: the most blocks they take beyond those held at the
    snapshot is at most `peak_growth`, and no more than one block per sequence above it (its rounding). With a
    40-token budget, some prompts are still being computed in chunks at the snapshot."""
    lengths = [3, 40, 17, 64, 9, 33, 25, 50]
    requests = [make_request(f"r{i}", prompt(6 + 5 * i, 100 * i), max_new_tokens=n) for i, n in enumerate(lengths)]
    requests.append(make_request("g", prompt(13, 900), max_new_tokens=30, n=3))
    s = sim(*requests, num_blocks=512, block_size=4, max_batch_tokens=max_batch_tokens, max_num_seqs=64)
    manager = s.scheduler.block_manager
    s.step()
    s.scheduler.pause_admission()  # only the running requests from here on
    running = list(s.scheduler.running)
    lifetimes = [lifetime(r, manager.ref_counts, manager.block_size) for r in running]
    if max_batch_tokens == 512:  # every prompt computed, the group forked
        assert len(running) == len(requests) + 2 and all(life.growing for life in lifetimes)
    else:
        assert 0 < len(running) < len(requests) and not all(life.growing for life in lifetimes)
    peak = peak_growth(lifetimes, manager.block_size)
    free_at_snapshot, least_free = manager.num_free_blocks, manager.num_free_blocks
    while any(not r.is_finished for r in running):
        s.step()
        least_free = min(least_free, manager.num_free_blocks)
    taken = free_at_snapshot - least_free
    assert 0 < taken <= peak <= taken + 2 * len(running)


def known_lengths(s) -> None:
    """Admission as after 64 requests that each ended at its max_new_tokens."""
    for _ in range(s.scheduler.admission.growth.recent_window):
        s.scheduler.admission.growth.finished(100, 100)


def test_known_lengths_admit_nothing_they_would_preempt_for():
    """Cases a future peak that ignored them got wrong (each preempted): a request reusing through the prefix cache
    blocks that a running request would free when it ends; a long prompt computed in chunks after its admission; a
    group's forked samples that have yet to copy the partial block they share; a running prompt computed a few tokens
    a step (prefill_first) while others decode; a cached prefix chained through blocks of two requests (blocks held
    alone that are not the last ones); more sequences than the token budget holds."""

    def prefix_reuse():
        s = sim(
            make_request("a", prompt(24, 100), max_new_tokens=2),
            make_request("b", prompt(3, 500), max_new_tokens=20),
            num_blocks=16,
            block_size=4,
            max_batch_tokens=512,
        )
        known_lengths(s)
        s.step()
        s.scheduler.add(make_request("c", prompt(24, 100) + [999], max_new_tokens=20))  # a's prompt, one more token
        return s

    def chunked_prompt():
        requests = [make_request(f"d{i}", prompt(100, 1000 * i), max_new_tokens=300) for i in range(8)]
        s = sim(*requests, num_blocks=500, block_size=16, max_batch_tokens=2048, max_num_seqs=256)
        known_lengths(s)
        for _ in range(100):
            s.step()
        s.scheduler.add(make_request("long", prompt(6000, 50_000), max_new_tokens=200))
        return s

    def forked_group():
        group = make_request("g", prompt(2, 100), max_new_tokens=16, n=8)
        s = sim(group, make_request("r", prompt(25, 900), max_new_tokens=45), num_blocks=48, block_size=4)
        known_lengths(s)
        return s

    def prompt_in_small_chunks():
        d = make_request("d", prompt(3, 100), max_new_tokens=54)
        q = make_request("q", prompt(55, 5000), max_new_tokens=6)
        s = sim(d, q, num_blocks=40, block_size=4, max_batch_tokens=3, policy="prefill_first")
        known_lengths(s)
        s.step()
        s.step()
        s.scheduler.add(make_request("c", prompt(2, 7000), max_new_tokens=56))
        return s

    def prefix_through_two_holders():  # c's cached prefix chains b's copy of a block and blocks of a's output
        s = sim(num_blocks=43, block_size=4, max_batch_tokens=512)
        known_lengths(s)
        x = list(range(100, 112))
        s.scheduler.add(make_request("a", [*x, 999], max_new_tokens=80))
        s.step()
        s.scheduler.add(make_request("b", x[:8], max_new_tokens=20))  # a prompt ending on a block boundary
        for _ in range(15):
            s.step()
        s.scheduler.add(make_request("c", [*x[:8], TOKEN, TOKEN, TOKEN, TOKEN, 555], max_new_tokens=60))
        s.step()
        s.scheduler.add(make_request("d", prompt(2, 5000), max_new_tokens=44))
        return s

    def decodes_fill_the_budget():  # 5 sequences, a 4-token budget: a prompt would wait behind the decodes
        requests = [
            make_request("a", [1752], max_new_tokens=11),
            make_request("b", [1284, 1127, 1188, 1872, 1816, 1716, 1762], max_new_tokens=18),
            make_request("g", [1947], max_new_tokens=29, n=3),
        ]
        s = sim(*requests, num_blocks=28, block_size=4, max_batch_tokens=4, max_num_seqs=5, policy="prefill_first")
        known_lengths(s)
        return s

    cases = (prefix_reuse, chunked_prompt, forked_group, prompt_in_small_chunks)
    for case in (*cases, prefix_through_two_holders, decodes_fill_the_budget):
        s = case()
        outputs = s.drain(max_steps=5000)
        assert all(r.num_output_tokens == r.max_new_tokens for r in outputs.values()), case.__name__
        assert s.scheduler.num_preemptions == 0, case.__name__


def test_known_lengths_run_without_a_preemption_where_the_growth_ratio_preempts(request):
    """Every request ends at its max_new_tokens, in a cache a third the size of their sum: once the first ones end
    so, the reserve is the exact future peak, and none is preempted; the ratio estimate alone (patched in) admits
    more than fits and preempts."""

    def run() -> tuple[int, dict]:
        lengths = [5, 90, 12, 60, 8, 120, 30, 75, 10, 45, 100, 20, 66, 15, 80, 40]
        requests = [make_request(f"r{i}", prompt(6, 20 * i), max_new_tokens=n) for i, n in enumerate(lengths)]
        s = sim(*requests, num_blocks=70, block_size=4, max_batch_tokens=64, max_num_seqs=16)
        outputs = s.drain(max_steps=5000)
        assert all(outputs[r.request_id].num_output_tokens == r.max_new_tokens for r in requests)
        return s.scheduler.num_preemptions, outputs

    preemptions, _ = run()
    assert preemptions == 0
    request.getfixturevalue("unknown_lengths")
    ratio_preemptions, _ = run()
    assert ratio_preemptions > 0


class RightDrafter:
    """Proposes 4 tokens for request "j" in thin steps; the fake sampler draws them all (every draft accepted)."""

    def speculates(self, num_decodes: int) -> bool:
        return num_decodes <= 8

    def propose(self, request, limit: int) -> tuple[int, ...]:
        return (TOKEN,) * min(4, limit) if request.request_id == "j" else ()


def run_with_drafts(scheduler) -> int:
    """Steps the scheduler to the end as the engine does with a drafter (no model: every token is TOKEN, so every
    draft stands, verified one position at a time as `verify.accept_drafts` does); returns the steps taken."""
    steps = 0
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        steps += 1
        scheduler.advance(batch, 0)
        scheduler.resolve(batch, [TOKEN] * len(batch.samples))
        live, position = [(seq.request, seq.draft) for seq in batch.sequences if seq.draft], 0
        while live := [(r, d) for r, d in live if position < len(d) and not r.is_finished]:
            position += 1
            check = ScheduledBatch()
            for row, (request, _) in enumerate(live):
                check.sequences.append(ScheduledSequence(request, request.num_computed_tokens, 1))
                check.logits_sequences.append(row)
                check.samples.append((request, row))
            scheduler.advance(check, 0)
            scheduler.resolve(check, [TOKEN] * len(live))
        assert steps < 1000
    return steps


def test_drafts_take_no_block_the_running_requests_are_known_to_grow_into():
    """A sample whose drafts are all accepted grows up to 5 tokens a step, faster than the future peak's one: its
    drafts may not take the blocks another request's growth was counted on, so nothing is preempted, and it still
    drafts where blocks are spare (fewer steps than one token a step)."""
    s = make_scheduler(num_blocks=40, block_size=4, max_batch_tokens=64)
    known_lengths(Sim(s))
    s.drafter = RightDrafter()
    s.add(make_request("i", prompt(60, 100), max_new_tokens=20))
    s.add(make_request("j", prompt(3, 500), max_new_tokens=100))
    steps = run_with_drafts(s)
    assert s.num_preemptions == 0 and steps < 100
    s.block_manager.check_all_free()


def test_victim_is_the_request_that_loses_fewest_tokens():
    """Not the newest arrival: the request whose computed tokens, beyond blocks it shares, are the fewest; one
    whose blocks are all shared (it would free nothing) comes last."""
    manager = BlockManager(num_blocks=32, block_size=4)
    old = make_request("old", prompt(6))
    new = make_request("new", prompt(14, 50))
    leader = make_request("g", prompt(16, 90), n=2)
    for arrival, request in enumerate((old, new, leader)):
        request.arrival = arrival
        manager.allocate(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
    fork = leader.fork(1, "g#1", arrival=3)
    manager.fork(leader, fork)
    fork.token_ids += [TOKEN] * 3
    manager.allocate(fork, 3)  # 16 shared prompt tokens, 3 of its own
    fork.num_computed_tokens = 19
    running = [old, new, leader, fork]
    assert cheapest_victim(running, set(), manager.ref_counts, 4) is fork  # loses 3 tokens
    assert cheapest_victim(running, {id(fork)}, manager.ref_counts, 4) is old  # 6, though the oldest
    assert cheapest_victim(running, {id(fork), id(old)}, manager.ref_counts, 4) is new  # 14
    assert cheapest_victim([leader], set(), manager.ref_counts, 4) is leader  # loses nothing, frees nothing


def test_admission_keeps_the_running_requests_growth_free():
    """A prompt that fits in the free blocks still waits while the running request is expected to grow into them,
    and runs once it finished; with a cache large enough for both, it is admitted at once."""
    for num_blocks, admitted_with_first in ((28, False), (80, True)):
        first = make_request("first", prompt(8), max_new_tokens=100)
        second = make_request("second", prompt(8, 50), max_new_tokens=100)
        s = sim(first, num_blocks=num_blocks, block_size=4, max_batch_tokens=64)
        s.step()
        s.scheduler.add(second)
        s.step()  # free: num_blocks - 3; needed: 2 for its prompt, 13 + 13 for half of 100 tokens each
        assert (second in s.scheduler.running) == admitted_with_first
        while second not in s.scheduler.running:
            s.step()
        assert first.is_finished == (not admitted_with_first) and s.scheduler.num_preemptions == 0
        outputs = s.drain()
        assert outputs["first"].output_ids == outputs["second"].output_ids == [TOKEN] * 100


def test_requests_with_one_prompt_admitted_together_compute_it_once():
    """Four requests with the same 20-token prompt (n=1 each, as the HTTP API sends a group): the first computes
    the prompt, the others wait one step and take its 4 full blocks from the prefix cache."""
    requests = [make_request(f"r{i}", prompt(20), max_new_tokens=3) for i in range(4)]
    s = sim(*requests, num_blocks=64, block_size=4, max_batch_tokens=256)
    batch, _ = s.step()
    assert [(seq.request.request_id, seq.start, seq.num_tokens) for seq in batch.sequences] == [("r0", 0, 20)]
    batch, _ = s.step()
    assert [(seq.request.request_id, seq.start, seq.num_tokens) for seq in batch.sequences] == [
        ("r0", 20, 1),
        ("r1", 16, 4),
        ("r2", 16, 4),
        ("r3", 16, 4),
    ]
    assert all(o.output_ids == [TOKEN] * 3 for o in s.drain().values())


def test_running_samples_stay_within_max_num_seqs_under_prefill_first():
    """A leader of 4 samples still computing its prompt in chunks counts as 4 sequences: prefill_first admits the
    short requests behind it only as sequences free up, so no running request holds KV without being computed."""
    leader = make_request("g", prompt(40), max_new_tokens=50, n=4)
    s = sim(leader, num_blocks=256, block_size=4, max_batch_tokens=16, max_num_seqs=4, policy="prefill_first")
    s.step()  # 16 of its 40 prompt tokens
    for i in range(3):
        s.scheduler.add(make_request(f"r{i}", prompt(4, 100 + 10 * i), max_new_tokens=50))
    for _ in range(60):
        s.step()
        assert len(s.scheduler.running) <= 4
    assert len(s.drain()) == 7


def test_a_group_larger_than_max_num_seqs_does_not_wait_for_an_empty_batch():
    """A group of 8 with max_num_seqs 4 goes in while a long request runs (as before the limit was enforced), and
    the short requests behind it are not held until the long one ends."""
    s = sim(make_request("long", prompt(4), max_new_tokens=200), num_blocks=512, block_size=4, max_num_seqs=4)
    s.step()
    s.scheduler.add(make_request("group", prompt(8, 50), max_new_tokens=20, n=8))
    s.step()
    assert any(r.group_id == "group" for r in s.scheduler.running)
    outputs = s.drain()
    assert len(outputs) == 9 and outputs["long"].num_output_tokens == 200
