"""Cases found by attacking a live `rollout-worker` with one honest client beside each attacker (isolation review,
2026-12-02). Each states what a client did, what it cost another client, and what is promised instead.

Express-lane turn drift: a client that floods the queue with long groups, beside a client that sends short requests
one after another (an agent's calls, an eval), makes every 33rd short request wait for a long group's whole life
(224 steps against 4: about 6 s on the tiny preset, on CPU), then again every 33rd. Each short request admitted
through the express lane advances `ClientTurns.admitted` to its own turn, past the long client's queue head that the
lane passed; the next short request's turn is one past it, so each lands one place further back in the queue, and
the 33rd lands past the `EXPRESS_SCAN` (32) waiting requests a step looks at for the lane. The promise
(docs/guides/production.md: "A short request does not wait for long ones to end") holds for the first 32 only.
Cause: `add_waiting` (step_builder.py) let a lane admission advance `ClientTurns.admitted` (client_turns.py),
as a gate admission does; a lane admission now leaves it where it was.
"""

from __future__ import annotations

from test_scheduler import prompt, sim

from conftest import make_request
from rollout.engine.scheduling.waiting_cursor import EXPRESS_SCAN
from rollout.engine.weights.commit_modes import recompute_in_flight


def _from(client: str, request):
    request.client = client
    return request


def test_short_requests_one_after_another_all_pass_a_flooded_queue_through_the_lane():
    """Client "a" queues long groups (the growth reserve runs what fits, the rest wait: its queue head does not fit for
    the whole test); client "b" sends short requests one at a time, each when the last ended. Every one of them is
    admitted through the lane and ends 4 steps after it was sent (one token a step), not only the first
    EXPRESS_SCAN of them."""
    long_groups = [_from("a", make_request(f"a{i}", prompt(8, 10 + i), max_new_tokens=300)) for i in range(40)]
    runner = sim(*long_groups, num_blocks=100, block_size=4, max_batch_tokens=256)
    runner.step()
    head = runner.scheduler.waiting[0]
    waits = []
    for index in range(EXPRESS_SCAN + 8):
        short = _from("b", make_request(f"b{index}", prompt(3, 60), max_new_tokens=4))
        runner.scheduler.add(short)
        steps = 0
        while short.request_id not in runner.finished and steps < 100:
            runner.step()
            steps += 1
        waits.append(steps)
    assert waits == [4] * len(waits), f"steps each short request waited: {waits}"
    assert head in runner.scheduler.waiting  # a's queue head never fitted: nothing but the lane admitted b's requests


def test_one_client_queue_stays_in_arrival_order_when_the_lane_admits_past_its_head():
    """One client (in-process callers are all ""): the lane admits a short request past two long ones that wait;
    a request sent after it still queues behind both, as every request of one client does (arrival order)."""
    from collections import deque

    from rollout.engine.scheduling.client_turns import ClientTurns

    turns, waiting = ClientTurns(), deque()
    head, second, short = (make_request(name, prompt(8), max_new_tokens=4) for name in ("head", "second", "short"))
    for request in (head, second, short):
        turns.queue(waiting, request)
    waiting.remove(short)
    turns.passed(waiting, short)  # what add_waiting does when the lane admits it
    later = make_request("later", prompt(8), max_new_tokens=4)
    turns.queue(waiting, later)
    assert [request.request_id for request in waiting] == ["head", "second", "later"]


def test_a_lane_sample_reset_by_a_recompute_update_is_readmitted_before_requests_sent_after_it():
    """Client "b"'s two short requests run through the express lane beside "a"'s long groups (the lane leaves their
    turns past the newest admitted: `ClientTurns.passed`); a weight update with commit mode "recompute" puts every
    sample in flight back at the head of the queue, "oldest first, ahead of new requests" (commit_modes.py); then
    client "c" sends a long request. The in-flight samples are readmitted first, in arrival order, so b's second
    short request ends within a few steps. It went behind c's request (its turn was later than c's new one) and
    waited for a's long groups to end: 407 steps against 2."""
    runner = sim(
        *(_from("a", make_request(f"a{i}", prompt(8, 10 + i), max_new_tokens=300)) for i in range(3)),
        num_blocks=100,
        block_size=4,
        max_batch_tokens=256,
    )
    scheduler = runner.scheduler
    runner.step()
    shorts = [_from("b", make_request(f"s{i}", prompt(2, 60 + i), max_new_tokens=3)) for i in range(2)]
    for short in shorts:
        scheduler.add(short)
    runner.step()
    assert all(short.express_blocks for short in shorts)  # both through the lane, each with a token sampled
    scheduler.abort(*(request.group_id for request in list(scheduler.waiting)))  # a's queue: only its running groups
    in_flight = sorted(scheduler.running, key=lambda request: request.arrival)
    recompute_in_flight(scheduler)
    scheduler.add(_from("c", make_request("c0", prompt(8, 80), max_new_tokens=300)))
    assert [request.request_id for request in scheduler.waiting] == [r.request_id for r in in_flight] + ["c0"]
    steps = 0
    while not all(short.request_id in runner.finished for short in shorts) and steps < 50:
        runner.step()
        steps += 1
    assert all(short.request_id in runner.finished for short in shorts), "a reset lane sample waits for a long group"


def test_a_new_clients_short_request_passes_the_queued_groups_of_more_clients_than_the_lane_scans():
    """Isolation review, 2026-12-05: 40 clients each queue one long group (one turn each: a new client's group
    queues behind every other client's next one), then a new client sends a short request. The lane looked only
    EXPRESS_SCAN (32) waiting requests past the queue head that did not fit, so the short request waited for long
    groups to end (8.8 s behind 40 ZeroMQ clients on a 2-core CPU, past the client's 120 s timeout behind 100).
    It ends 4 steps after it was sent, as behind fewer clients; the long groups keep their turns."""
    clients = 3 * EXPRESS_SCAN
    long_groups = [
        _from(f"c{i}", make_request(f"long{i}", prompt(8, 10 + i), max_new_tokens=300)) for i in range(clients)
    ]
    runner = sim(*long_groups, num_blocks=100, block_size=4, max_batch_tokens=256)
    runner.step()
    waiting_before = [request.request_id for request in runner.scheduler.waiting]
    assert len(waiting_before) > EXPRESS_SCAN + 1  # the short request queues past what the lane used to scan
    short = _from("new", make_request("short", prompt(3, 60), max_new_tokens=4))
    runner.scheduler.add(short)
    assert [request.request_id for request in runner.scheduler.waiting].index("short") > EXPRESS_SCAN
    steps = 0
    while "short" not in runner.finished and steps < 100:
        runner.step()
        steps += 1
    assert steps == 4
    assert [r.request_id for r in runner.scheduler.waiting] == waiting_before  # none of the long groups was admitted
