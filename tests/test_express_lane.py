"""The express lane (`rollout.engine.scheduling.express_lane`): a short request is admitted past the growth reserve
and past a queue head that does not fit, within a small share of the cache."""

from __future__ import annotations

import torch
from test_scheduler import Sim, prompt, sim

from conftest import make_engine, make_request, make_scheduler, reference_copy, tiny_model
from rollout.engine.requests.group_spec import GroupSpec
from rollout.engine.requests.request import Request, RequestStatus
from rollout.engine.scheduling.express_lane import life_blocks
from rollout.sampling_params import SamplingParams


def _from(client: str, request: Request) -> Request:
    request.client = client
    return request


def _long_client(count: int, max_new_tokens: int = 200) -> list[Request]:
    """Client "a": long requests; the growth reserve admits three of them into a 100-block cache (two of 300
    tokens), the rest wait."""
    return [_from("a", make_request(f"a{i}", prompt(8, 10 + i), max_new_tokens)) for i in range(count)]


def _running(runner: Sim, client: str) -> list[Request]:
    return [r for r in runner.scheduler.running if r.client == client]


def test_a_short_request_passes_a_long_queue_that_waits_for_growth(unknown_lengths):
    """ "a" fills the cache's growth reserve and queues more; "b"'s 4-token request is admitted at once through the
    lane and ends 4 steps later, while a's queue head still waits. A "b" request one block longer than the lane waits
    its turn (it would have held the cache's reserve)."""
    runner = sim(*_long_client(6), num_blocks=100, block_size=4, max_batch_tokens=256)
    assert runner.scheduler.admission.express.capacity == 2
    for _ in range(3):
        runner.step()
    assert len(_running(runner, "a")) == 3 and len(runner.scheduler.waiting) == 3
    short = _from("b", make_request("b-short", prompt(3, 60), max_new_tokens=4))
    too_long = _from("b", make_request("b-long", prompt(3, 70), max_new_tokens=8))
    assert life_blocks(short, 4) == 2 and life_blocks(too_long, 4) == 3
    runner.scheduler.add(short)
    runner.scheduler.add(too_long)
    for _ in range(4):
        _, finished = runner.step()
        assert too_long.status == RequestStatus.WAITING and len(_running(runner, "a")) == 3
    assert [r.request_id for r in finished] == ["b-short"]  # one token a step: its prompt's step samples the first
    runner.drain(max_steps=2000)
    assert runner.finished["b-long"].num_output_tokens == 8


def test_the_lane_holds_its_share_at_most(unknown_lengths):
    """Twenty short requests queued behind ten long ones, eight of which wait for the growth reserve: they pass them
    through the lane one whole life at a time (its 2% of 100 blocks is two blocks, a short request's life), and all end while the
    long ones still wait."""
    shorts = [make_request(f"s{index}", prompt(3, 40 + index), max_new_tokens=4) for index in range(20)]
    runner = sim(*_long_client(10, 300), *(_from("a", r) for r in shorts), num_blocks=100, block_size=4)
    capacity = runner.scheduler.admission.express.capacity
    most = 0
    for _ in range(160):
        runner.step()
        lives = sum(life_blocks(r, 4) for r in runner.scheduler.running if r.max_new_tokens == 4)
        assert lives <= capacity
        most = max(most, lives)
    assert most == capacity and all(r.request_id in runner.finished for r in shorts)
    assert len(runner.scheduler.waiting) == 8  # the long ones: the reserve still holds them back
    runner.drain(max_steps=3000)


def test_a_lane_request_keeps_the_tokens_transformers_generates(unknown_lengths):
    """Through the engine: client "b"'s greedy request passes client "a"'s long sampled groups (two run, two wait
    for their growth), ends first, and its tokens are transformers' greedy `generate`'s."""
    model = tiny_model()
    reference = reference_copy(model)
    engine = make_engine(model, num_blocks=100, block_size=4, max_batch_tokens=256)
    try:
        for index in range(4):
            sampling = SamplingParams(do_sample=True, seed=index, max_new_tokens=100, stop_token_ids=())
            group = engine.intake.prepare(GroupSpec(f"a{index}", prompt(10, 5 + index), sampling, 3))
            group.client = "a"
            engine.submit(group)
        engine.step()
        short = _greedy_from_b(engine, lambda steps: engine.num_waiting == 2)  # a's other groups: held back
    finally:
        engine.cancel(*engine.open_group_ids())
        engine.close()
    _assert_generates(reference, short)


def _greedy_from_b(engine, each_step, most_steps: int = 100) -> Request:
    """Submit client "b"'s greedy 4-token request and step until it ends, first of all (`each_step(steps)` checked
    after every step); returns it."""
    greedy = SamplingParams(do_sample=False, max_new_tokens=4, stop_token_ids=())
    short = engine.intake.prepare(GroupSpec("b", prompt(3, 40), greedy, 1))
    short.client = "b"
    engine.submit(short)
    finished, steps = [], 0
    while not finished:
        finished = [o.request_id for o in engine.step() if o.is_finished]
        steps += 1
        assert each_step(steps) and steps <= most_steps, f"b waited {steps} steps"
    assert finished == ["b"]
    return short


def _assert_generates(reference, short: Request) -> None:
    """b's tokens are transformers' greedy `generate`'s."""
    expected = reference.generate(torch.tensor([prompt(3, 40)]), max_new_tokens=4, do_sample=False)
    assert short.token_ids[3:] == expected[0, 3:].tolist()


def test_a_group_that_needs_an_empty_cache_is_not_passed_for_ever():
    """A group of 16 x 1000 tokens may only go in once nothing runs (its life is most of the cache); short requests
    from another client keep coming. The lane closes behind it: the running ones drain and it goes in, as it did
    before the lane (step 301 here), where short requests passing it would keep something running for ever."""
    scheduler = make_scheduler(num_blocks=1000, block_size=4, max_batch_tokens=4096, max_num_seqs=256)
    runner = Sim(scheduler)
    for index in range(4):
        scheduler.add(_from("a", make_request(f"a{index}", prompt(16, 100 * index), max_new_tokens=300)))
    runner.step()
    big = _from("a", make_request("big", prompt(16, 9000), max_new_tokens=1000, n=16))
    scheduler.add(big)
    assert scheduler.admission.express.closes_behind(big)
    shorts = 0
    for _ in range(400):
        while sum(1 for r in scheduler.waiting if r.client == "b") < 5:
            scheduler.add(_from("b", make_request(f"b{shorts}", prompt(3, 20000 + shorts), max_new_tokens=4)))
            shorts += 1
        runner.step()
        if big.status != RequestStatus.WAITING:
            break
    assert big.status == RequestStatus.RUNNING
    for request in list(scheduler.waiting):
        scheduler.abort(request.group_id)
    runner.drain(max_steps=3000)


def test_preempted_lane_samples_keep_the_lane_within_its_share(unknown_lengths):
    """Client "a"'s long requests overflow the cache and preempt; client "b" keeps short groups of 4 queued, which
    take the lane. Every running sample admitted through it carries its share (a preempted one leaves the lane and
    comes back through the queue), so at every step the shares of the running ones stay within the lane's capacity
    and each covers what its sample holds alone. (Keyed by group, a preempted sample readmitted through the lane
    replaced its group's life by its own, and the lane let other groups into room the group still held.)"""
    scheduler = make_scheduler(num_blocks=500, block_size=4, max_batch_tokens=2048, max_num_seqs=256)
    capacity = scheduler.admission.express.capacity
    runner = Sim(scheduler)
    for index in range(20):
        scheduler.add(_from("a", make_request(f"a{index}", prompt(8, 10 * index), max_new_tokens=600)))
    groups, used = 0, []
    for _ in range(700):
        if sum(1 for r in scheduler.waiting if r.client == "b") < 3:
            scheduler.add(_from("b", make_request(f"g{groups}", prompt(2, 7000 + 10 * groups), max_new_tokens=5, n=4)))
            groups += 1
        runner.step()
        lane = [r for r in scheduler.running if r.express_blocks]
        assert all(r.num_own_blocks <= r.express_blocks for r in lane)
        used.append(sum(r.express_blocks for r in lane))
        assert used[-1] <= capacity
    group_life = life_blocks(make_request("g", prompt(2), max_new_tokens=5, n=4), 4)
    assert max(used) == group_life and group_life + group_life > capacity and scheduler.num_preemptions > 0
    for request in list(scheduler.waiting) + list(scheduler.running):
        scheduler.abort(request.group_id)
    runner.drain(max_steps=10)


def test_a_short_request_runs_beside_a_group_larger_than_max_num_seqs():
    """Client "a"'s group of 32 samples holds every one of the 16 sequence slots for its life; client "b"'s 4-token
    request takes one of the lane's own slots and ends within a few steps (before the lane's slots it waited for the
    group to end, 300 steps here). No step computes more than max_num_seqs sequences, and the group's samples each
    get all their tokens (Sim checks every step's KV)."""
    scheduler = make_scheduler(num_blocks=2000, block_size=4, max_batch_tokens=256, max_num_seqs=16)
    assert scheduler.admission.express.seats == 1
    runner = Sim(scheduler)
    scheduler.add(_from("a", make_request("big", prompt(8, 100), max_new_tokens=300, n=32)))
    for _ in range(3):
        runner.step()
    assert sum(1 for r in scheduler.running if r.client == "a") == 32  # forked: twice the slots
    short = _from("b", make_request("b-short", prompt(3, 60), max_new_tokens=4))
    scheduler.add(short)
    steps = 0
    while "b-short" not in runner.finished:
        runner.step()
        steps += 1
        assert steps <= 6, "the short request waited behind the group"
    assert short.num_output_tokens == 4
    assert sum(1 for r in scheduler.running if r.client == "a") == 32  # none of a's samples preempted or ended
    finished = runner.drain(max_steps=3000)
    assert sum(1 for r in finished.values() if r.client == "a" and r.num_output_tokens == 300) == 32


def test_the_lane_never_takes_more_than_its_own_slots_past_a_full_running_set():
    """Many short requests from "b" behind a group that fills every slot: at most the lane's seats of them run at
    once (the others wait their turn), so the group keeps max_num_seqs - seats slots every step."""
    scheduler = make_scheduler(num_blocks=4000, block_size=4, max_batch_tokens=256, max_num_seqs=32)
    seats = scheduler.admission.express.seats
    assert seats == 2
    runner = Sim(scheduler)
    scheduler.add(_from("a", make_request("big", prompt(8, 100), max_new_tokens=200, n=48)))
    for _ in range(3):
        runner.step()
    shorts = [_from("b", make_request(f"b{i}", prompt(3, 60 + i), max_new_tokens=4)) for i in range(10)]
    for request in shorts:
        scheduler.add(request)
    for _ in range(40):
        batch, _ = runner.step()
        lane = [seq for seq in batch.sequences if seq.request.client == "b"]
        assert len(lane) <= seats
        assert len(batch.sequences) - len(lane) >= 32 - seats
    assert all(r.request_id in runner.finished for r in shorts)
    runner.drain(max_steps=3000)


def test_a_lane_request_beside_a_group_larger_than_max_num_seqs_keeps_transformers_tokens():
    """Through the engine: client "a"'s sampled group of 12 holds all 8 sequence slots; client "b"'s greedy request
    runs in the lane's slot, ends while the group still runs, and its tokens are transformers' greedy `generate`'s."""
    model = tiny_model()
    reference = reference_copy(model)
    engine = make_engine(model, num_blocks=400, block_size=4, max_batch_tokens=256, max_num_seqs=8)
    try:
        sampling = SamplingParams(do_sample=True, seed=3, max_new_tokens=200, stop_token_ids=())
        group = engine.intake.prepare(GroupSpec("a", prompt(10, 5), sampling, 12))
        group.client = "a"
        engine.submit(group)
        for _ in range(2):
            engine.step()
        short = _greedy_from_b(engine, lambda steps: True, most_steps=8)  # not behind the group
    finally:
        engine.cancel(*engine.open_group_ids())
        engine.close()
    _assert_generates(reference, short)


def test_a_lane_prefill_leaves_the_group_its_decodes():
    """Client "a"'s group of 32 holds every one of the 16 sequence slots; client "b" keeps sending requests whose
    prompts are as long as the lane's share (150 tokens, the step's budget 64). The lane's samples are computed
    first, but a lane prefill chunk takes only the budget the group's decodes leave: every step computes 15 of the
    group's samples (before, a lane prefill took whole steps' budgets, and the group got no token in them), and b's
    requests still end, a few steps each."""
    scheduler = make_scheduler(num_blocks=2000, block_size=4, max_batch_tokens=64, max_num_seqs=16)
    seats = scheduler.admission.express.seats
    assert life_blocks(make_request("b", prompt(150), max_new_tokens=2), 4) <= scheduler.admission.express.capacity
    runner = Sim(scheduler)
    scheduler.add(_from("a", make_request("big", prompt(8, 100), max_new_tokens=300, n=32)))
    for _ in range(3):
        runner.step()
    sent = 0
    for _ in range(60):
        while sum(1 for r in scheduler.waiting if r.client == "b") < 2:
            scheduler.add(_from("b", make_request(f"b{sent}", prompt(150, 10000 + 1000 * sent), max_new_tokens=2)))
            sent += 1
        batch, _ = runner.step()
        assert sum(1 for seq in batch.sequences if seq.request.client == "a") >= 16 - seats
    assert sum(1 for r in runner.finished.values() if r.client == "b") >= 10
    for request in list(scheduler.waiting) + list(scheduler.running):
        scheduler.abort(request.group_id)
    runner.drain(max_steps=10)


def test_a_lane_sample_swapped_out_and_back_in_leaves_the_lane(unknown_lengths):
    """As `test_preempted_lane_samples_keep_the_lane_within_its_share`, with swap space: a lane sample swapped out
    leaves the lane's share to others, so once swapped back in (through the gate) it carries no share (it kept its
    own, and the lane's running shares summed past its capacity)."""
    scheduler = make_scheduler(
        num_blocks=500, block_size=4, max_batch_tokens=2048, max_num_seqs=256, num_swap_blocks=1000
    )
    capacity = scheduler.admission.express.capacity
    runner = Sim(scheduler)
    for index in range(20):
        scheduler.add(_from("a", make_request(f"a{index}", prompt(8, 10 * index), max_new_tokens=300)))
    groups = 0
    for _ in range(700):
        if sum(1 for r in scheduler.waiting if r.client == "b") < 3:
            scheduler.add(_from("b", make_request(f"g{groups}", prompt(2, 7000 + 10 * groups), max_new_tokens=5, n=4)))
            groups += 1
        runner.step()
        assert sum(r.express_blocks for r in scheduler.running) <= capacity
    assert scheduler.num_swaps > 0
    for request in list(scheduler.waiting) + list(scheduler.swapped) + list(scheduler.running):
        scheduler.abort(request.group_id)
    runner.drain(max_steps=10)
