"""Cases found by a randomized simulation fuzz of the scheduler (several clients, groups, chunked prompts, small
caches, preemption, weight-update commits, aborts, pauses), 2026-12-02. Each is shrunk to the few requests that
break a promise, counted in steps, never time.
"""

from __future__ import annotations

from test_scheduler import Sim

from conftest import make_request, make_scheduler
from rollout.engine.scheduling.express_lane import fork_share


def _lane_blocks(scheduler) -> int:
    """The blocks the lane's running samples may hold over their lives: each lane sample's share, and the share of
    each sample a lane leader will still fork (the lane's own rule, `express_lane.py`, counted from outside)."""
    block_size = scheduler.block_manager.block_size
    return sum(
        request.express_blocks + request.num_forks * fork_share(request, block_size)
        for request in scheduler.running
        if request.express_blocks
    )


def test_a_lane_group_whose_prompt_is_chunked_keeps_its_samples_shares_until_it_forks():
    """The lane (2% of 300 blocks: 6) admits a group of 2 samples (life 4 blocks: the leader's 2 and its fork's 2)
    while a group of 4 holds the gate's growth reserve (admission was paused for a step, as for a weight update). Its 7-token prompt is computed over two steps (a budget of 4
    tokens), and it forks its second sample only at the end. A short request (life 3 blocks) arriving meanwhile was
    admitted through the lane as if the unforked sample held nothing: the lane's samples then held 7 blocks of its 6.
    The lane counts the unforked sample's share, so the short request waits for room instead."""
    scheduler = make_scheduler(
        num_blocks=300, block_size=4, max_batch_tokens=4, max_num_seqs=64, prefix_caching=False, policy="prefill_first"
    )
    runner = Sim(scheduler)
    capacity = scheduler.admission.express.capacity
    arrivals = {
        0: [make_request("tiny", [29624], max_new_tokens=2), make_request("group", [27360], max_new_tokens=4, n=4)],
        1: [make_request("lane_group", list(range(100, 107)), max_new_tokens=2, n=2)],
        2: [make_request("short", list(range(200, 208)), max_new_tokens=2)],
    }
    lane_admitted = []
    for step in range(40):
        for request in arrivals.get(step, []):
            scheduler.add(request)
        if step == 1:
            scheduler.pause_admission()  # a weight update's drain, for a step
        if step == 2:
            scheduler.resume_admission()
        runner.step()
        lane_admitted += [
            r.request_id for r in scheduler.running if r.express_blocks and r.request_id not in lane_admitted
        ]
        assert _lane_blocks(scheduler) <= capacity, f"step {step}: the lane's samples may hold more than its share"
        if not scheduler.has_unfinished():
            break
    assert "lane_group#0" in lane_admitted  # the case's point: the group went through the lane
    assert len(runner.drain()) == 8
