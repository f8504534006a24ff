"""A short request from another client beside one group whose samples' growth far exceeds the cache (the attack on a
live worker: n=1024 samples of a 2,000-token prompt in 512 blocks). The group is preempted by the hundred; the short
request still ends a few steps after it arrives (`express_lane.py`), and the group's prompt is computed once, however
often its samples are preempted and readmitted (the prefix cache serves it). Counted in steps and tokens, never time.

The scale here: 128 samples of a 40-token prompt, 64 new tokens each, 200 blocks of 4 tokens (the group's life is
~2,200 blocks); 64 sequence slots.
"""

from __future__ import annotations

from test_scheduler import Sim, prompt

from conftest import make_request, make_scheduler
from rollout.engine.requests.request import Request, RequestStatus
from rollout.engine.scheduling.waiting_cursor import EXPRESS_SCAN

BLOCK_SIZE = 4
PROMPT = 40  # ten full blocks: all of them shared by the group's samples
SAMPLES = 128
NEW_TOKENS = 64
SHORT_NEW_TOKENS = 4
MOST_WAIT = 20  # steps: the short request's 4 tokens, and a few steps for a free block (the group takes ~500)


def _big_group() -> tuple[Sim, Request]:
    scheduler = make_scheduler(num_blocks=200, block_size=BLOCK_SIZE, max_batch_tokens=256, max_num_seqs=64)
    group = make_request("a", prompt(PROMPT, 10), max_new_tokens=NEW_TOKENS, n=SAMPLES)
    group.client = "a"
    scheduler.add(group)
    return Sim(scheduler), group


def _run(runner: Sim, short_after: int) -> dict:
    """Run the group, client "b"'s short request submitted after `short_after` steps, until both end. Returns the
    short request's wait in steps, the waiting requests ahead of it one step after it came, the group's samples
    that ended before it, every status it had, and the prompt tokens the steps computed for the group."""
    scheduler = runner.scheduler
    short = make_request("b", prompt(4, 5000), max_new_tokens=SHORT_NEW_TOKENS)
    short.client = "b"
    statuses, ahead, wait, group_ended, prompt_computed = [], None, None, None, 0
    for step in range(1, 3000):
        if step == short_after + 1:
            scheduler.add(short)
        batch, _ = runner.step()
        for seq in batch.sequences:
            if seq.request.group_id == "a":  # the group's tokens at prompt positions, however many recomputes
                prompt_computed += max(0, min(seq.start + seq.num_tokens, PROMPT) - seq.start)
        if step > short_after and wait is None:
            statuses.append(short.status)
            if ahead is None:
                ahead = list(scheduler.waiting).index(short) if short in scheduler.waiting else 0
            if short.request_id in runner.finished:
                wait = step - short_after
                group_ended = sum(1 for request_id in runner.finished if request_id.startswith("a"))
        if not scheduler.has_unfinished():
            break
    runner.drain()
    assert len(runner.finished) == SAMPLES + 1
    assert all(r.num_output_tokens == NEW_TOKENS for r in runner.finished.values() if r.group_id == "a")
    return dict(wait=wait, ahead=ahead, group_ended=group_ended, statuses=statuses, prompt_computed=prompt_computed)


def test_a_short_request_passes_hundreds_of_preempted_samples():
    """Arriving once the group's samples were preempted by the dozen (they go back to the head of the queue, ahead
    of it, more than EXPRESS_SCAN of them), the short request ends within a few steps, not after the group: the lane
    looks past the preempted samples, which it never admits. The prompt is computed once for all 128 samples."""
    runner, _ = _big_group()
    seen = _run(runner, short_after=14)
    assert runner.scheduler.num_preemptions > SAMPLES // 2  # the group thrashes, as in the attack
    assert seen["ahead"] > EXPRESS_SCAN  # the short request queued behind more preempted samples than the lane scans
    assert seen["wait"] is not None and seen["wait"] <= MOST_WAIT, f"b waited {seen['wait']} steps"
    assert seen["group_ended"] < SAMPLES // 2
    assert seen["prompt_computed"] == PROMPT


def test_a_short_request_the_lane_admitted_is_not_preempted_for_the_group():
    """Admitted through the lane just before the cache runs out, the short request is not taken as the preemption
    victim (its few tokens lose the least): preempted, it would come back through the queue, behind the group's
    hundred preempted samples, and wait for most of the group. It runs to its end in SHORT_NEW_TOKENS + 1 steps."""
    runner, _ = _big_group()
    seen = _run(runner, short_after=8)
    assert runner.scheduler.num_preemptions > SAMPLES // 2
    assert RequestStatus.WAITING not in seen["statuses"], "the lane's request was preempted"
    assert seen["wait"] == SHORT_NEW_TOKENS + 1  # admitted into the lane's slots (the set is full), then 4 steps
    assert seen["prompt_computed"] == PROMPT
