"""The compile slots' fair queue (rollout/service/compile/fair_queue.py): clients take turns, each holds at most its
share of slots, and each client's queue and the whole queue are bounded."""

from __future__ import annotations

import pytest

from rollout.service.compile.fair_queue import FairQueue, QueueBusy


def drain_order(queue: FairQueue) -> list[str]:
    order = []
    while (taken := queue.pop()) is not None:
        client, item = taken
        order.append(item)
        queue.done(client)
    return order


def test_clients_take_turns_whatever_the_order_they_sent_in():
    queue = FairQueue(max_waiting=100, max_waiting_per_client=10, max_running_per_client=1)
    for index in range(4):
        queue.push("greedy", f"g{index}")
    queue.push("one", "o0")
    queue.push("other", "x0")
    queue.push("one", "o1")
    assert drain_order(queue) == ["g0", "o0", "x0", "g1", "o1", "g2", "g3"]


def test_a_client_holds_at_most_its_share_of_slots():
    queue = FairQueue(max_waiting=100, max_waiting_per_client=10, max_running_per_client=1)
    queue.push("a", "a0")
    queue.push("a", "a1")
    assert queue.pop() == ("a", "a0")
    assert queue.pop() is None  # a1 waits for a0's slot, though a slot is free
    queue.push("b", "b0")
    assert queue.pop() == ("b", "b0")
    queue.done("a")
    assert queue.pop() == ("a", "a1")


def test_bounds_per_client_and_in_all_and_removal():
    queue = FairQueue(max_waiting=3, max_waiting_per_client=2, max_running_per_client=1)
    queue.push("a", "a0")
    assert queue.pop() == ("a", "a0")
    queue.push("a", "a1")
    with pytest.raises(QueueBusy, match="--max-compiles-per-client"):
        queue.push("a", "a2")  # one running and one waiting: its share
    queue.push("b", "b0")
    queue.push("c", "c0")
    with pytest.raises(QueueBusy, match="3 structured-output constraints are waiting"):
        queue.push("d", "d0")
    assert queue.remove("b", "b0") and not queue.remove("b", "b0") and not queue.remove("a", "a0")
    queue.push("d", "d0")
    assert queue.num_waiting == 3 and sorted(queue.drain()) == ["a1", "c0", "d0"] and queue.num_waiting == 0
