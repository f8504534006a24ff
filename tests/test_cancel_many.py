"""Many cancels at once: the engine ends them in one pass over its queues (thousands of cancels from one client
used to scan the waiting queue once per group on the engine thread: 5,000 cancels held every other client's steps
for about half a second)."""

from __future__ import annotations

from collections import deque

from conftest import make_prompts, make_request, make_scheduler, tiny_model
from rollout import ContinuousBatchingConfig, SamplingParams, init_continuous_batching

TIMEOUT = 60


class CountedQueue(deque):
    """A waiting queue that counts how often it is walked."""

    walks = 0

    def __iter__(self):
        CountedQueue.walks += 1
        return super().__iter__()


def test_aborting_many_groups_at_once_ends_the_same_samples_as_one_at_a_time_in_one_walk():
    """The same samples end, in the same order per group, whether 40 groups are aborted together or one by one;
    together, the waiting queue is walked a bounded number of times (one by one: once per group)."""
    requests = [make_request(f"g{index}", [index + 1] * 4, n=1 + index % 3) for index in range(60)]
    victims = [f"g{index}" for index in range(0, 60, 3)] + [f"g{index}" for index in range(1, 60, 3)]

    def queued():
        scheduler = make_scheduler(num_blocks=64)
        scheduler.waiting = CountedQueue()
        for request in requests:
            scheduler.add(make_request(request.group_id, request.token_ids, n=request.num_forks + 1))
        return scheduler

    alone = queued()
    CountedQueue.walks = 0
    one_by_one = [request.request_id for group_id in victims for request in alone.abort(group_id)]
    walks_one_by_one = CountedQueue.walks
    together = queued()
    CountedQueue.walks = 0
    at_once = [request.request_id for request in together.abort(*victims)]
    assert walks_one_by_one >= len(victims) and CountedQueue.walks <= 2
    assert sorted(at_once) == sorted(one_by_one) and len(at_once) == sum(1 + i % 3 for i in range(60) if i % 3 < 2)
    for group_id in victims:  # each group's samples come in the same order either way
        assert [r for r in at_once if r.startswith(f"{group_id}#") or r == group_id] == [
            r for r in one_by_one if r.startswith(f"{group_id}#") or r == group_id
        ]
    assert [r.group_id for r in together.waiting] == [f"g{index}" for index in range(2, 60, 3)]
    assert together.abort(*victims) == []  # already ended: nothing twice


def test_cancels_queued_behind_a_pause_end_together_and_spare_the_other_groups(monkeypatch):
    """300 groups cancelled while the engine loop is held reach the engine as one cancel of all of them (each
    ends with "abort", every sample answered); a group not cancelled runs to its length."""
    config = ContinuousBatchingConfig(num_blocks=256, block_size=4, max_num_seqs=4)
    manager = init_continuous_batching(tiny_model(), None, config)
    calls: list[tuple[str, ...]] = []
    original = manager.engine.cancel
    monkeypatch.setattr(manager.engine, "cancel", lambda *ids: calls.append(ids) or original(*ids))
    sampling = SamplingParams(do_sample=False, stop_token_ids=())
    with manager:
        groups = [
            manager.add_request(prompt, max_new_tokens=50, n=2, sampling=sampling) for prompt in make_prompts(300, 4, 8)
        ]
        kept = manager.add_request([5, 6, 7], request_id="kept", max_new_tokens=6, sampling=sampling)
        with manager.pause(timeout=TIMEOUT):
            for group in groups:
                manager.cancel_request(group)
        outputs = [manager.get_result(timeout=TIMEOUT) for _ in range(2 * len(groups) + 1)]
    assert None not in outputs
    ended = {output.request_id: output for output in outputs}
    assert all(ended[f"{group}#{i}"].finish_reason == "abort" for group in groups for i in range(2))
    assert ended[kept].finish_reason == "length" and len(ended[kept].generated_tokens) == 6
    assert sorted(calls, key=len)[-1] == tuple(groups)
    manager.engine.block_manager.check_all_free()
