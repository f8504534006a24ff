"""Express-lane shares when a lane group's leader ends before its samples (randomized scheduler fuzz, 2026-12-02).

A group admitted through the lane computes its prompt in its leader, which forks the other samples sharing every
prompt block. The prompt's full blocks were in the leader's share only (`Request.express_blocks`), so a leader that
stopped first took them out of the lane's count while its samples still held them, and the lane admitted a short
request into them: its running samples held more blocks than its capacity (by up to the prompt's full blocks).
"""

from __future__ import annotations

from test_scheduler import STOP, TOKEN, Sim, prompt

from conftest import make_request, make_scheduler


def _lane_blocks_held(scheduler) -> int:
    """The distinct KV blocks the lane's running samples hold (read from their block tables, not from shares)."""
    return len({block for request in scheduler.running if request.express_blocks for block in request.block_ids})


def test_lane_samples_never_hold_more_than_the_lane_when_the_leader_stops_first():
    """Long requests fill the gate's growth reserve, so the rest of the queue waits and short requests take the lane
    (2% of 300 blocks: 6). A lane group of 2 samples (8-token prompt: 2 full blocks; life 3 + 2 blocks) runs; its
    leader samples a stop token at once, its fork goes on, holding the 2 prompt blocks and one of its own. A short
    request (4 blocks) arriving then was admitted into the leader's released share: the lane's samples held 7 blocks.
    It waits for the fork to end instead, and then runs through the lane."""
    scheduler = make_scheduler(
        num_blocks=300, block_size=4, max_batch_tokens=256, max_num_seqs=64, prefix_caching=False
    )
    runner = Sim(scheduler)
    capacity = scheduler.admission.express.capacity
    for index in range(10):
        scheduler.add(make_request(f"long{index}", prompt(8, 1000 + 10 * index), max_new_tokens=300))
    runner.step()
    assert scheduler.waiting, "the case needs requests the gate keeps waiting"
    scheduler.add(make_request("group", prompt(8, 100), max_new_tokens=5, n=2, stop_token_ids=(STOP,)))
    short = make_request("short", prompt(13, 200), max_new_tokens=4)
    lane_samples = set()
    for step in range(12):
        if step == 2:
            scheduler.add(short)
        runner.step(lambda request: STOP if request.request_id == "group#0" else TOKEN)
        lane_samples |= {request.request_id for request in scheduler.running if request.express_blocks}
        assert _lane_blocks_held(scheduler) <= capacity, f"step {step}: the lane's samples hold more than its share"
    # The case's point: the fork ran through the lane without its leader, and the short request took the lane too.
    assert runner.finished["group#0"].finish_reason == "stop" and runner.finished["group#0"].num_output_tokens == 1
    assert runner.finished["group#1"].num_output_tokens == 5
    assert {"group#1", "short"} <= lane_samples
    assert runner.finished["short"].num_output_tokens == 4
