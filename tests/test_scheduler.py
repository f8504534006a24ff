"""Scheduler unit tests with a fake model: `schedule()`, then `advance()` and `resolve()` with one made-up token per sample.

`Sim` plays the engine and the model runner. Every step it checks the batch limits and runs a fake KV cache (block
copies in their documented order, then one write per scheduled token), asserting that each scheduled sequence reads
back exactly its own tokens, so wrong block tables, copy-on-write pairs or swap pairs fail loudly.
"""

from __future__ import annotations

from collections.abc import Callable

from conftest import make_request, make_scheduler
from rollout.engine.requests.request import Request, RequestStatus
from rollout.engine.scheduling.batch import ScheduledBatch
from rollout.engine.scheduling.scheduler import Scheduler

TOKEN = 7  # the fake sampler's token: never a stop token in these tests
STOP = 2


class Sim:
    """Drives a scheduler as the engine would, with a fake KV cache that holds token ids instead of tensors."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        manager = scheduler.block_manager
        self.block_size = manager.block_size
        self.device = [[None] * manager.block_size for _ in range(manager.num_blocks)]
        self.cpu = [[None] * manager.block_size for _ in range(manager.num_swap_blocks)]
        self.finished: dict[str, Request] = {}

    def step(self, token: int | Callable[[Request], int] = TOKEN) -> tuple[ScheduledBatch, list[Request]]:
        """One engine step; returns the batch and the requests that finished in it."""
        scheduler = self.scheduler
        batch = scheduler.schedule()
        assert batch.num_tokens <= scheduler.max_batch_tokens
        assert len(batch.sequences) <= scheduler.max_num_seqs
        for request, _ in batch.samples:
            assert request.status == RequestStatus.RUNNING, (
                f"{request.request_id} gets a token while {request.status.name}"
            )
        self._run_kv(batch)
        tokens = [token(r) if callable(token) else token for r, _ in batch.samples]
        # `advance` then `resolve`: the engine's update of a step whose tokens are already on the host.
        scheduler.advance(batch, scheduler.block_manager.policy_version)
        finished = batch.finished + [r for r in scheduler.resolve(batch, tokens) if r.is_finished]
        for request in finished:
            assert request.is_finished and request.request_id not in self.finished
            self.finished[request.request_id] = request
        return batch, finished

    def _run_kv(self, batch: ScheduledBatch) -> None:
        size = self.block_size
        for src, dst in batch.swap_out:
            self.cpu[dst] = list(self.device[src])
        for src, dst in batch.swap_in:
            self.device[dst] = list(self.cpu[src])
        for src, dst in batch.block_copies:
            self.device[dst] = list(self.device[src])
        for seq in batch.sequences:
            request = seq.request
            assert request.status == RequestStatus.RUNNING
            assert len(request.block_ids) * size >= seq.start + seq.num_tokens
            for pos in range(seq.start, seq.start + seq.num_tokens):
                self.device[request.block_ids[pos // size]][pos % size] = request.token_ids[pos]
        for seq in batch.sequences:  # attention reads every earlier position of the sequence
            request = seq.request
            kv = [self.device[request.block_ids[pos // size]][pos % size] for pos in range(seq.start + seq.num_tokens)]
            assert kv == request.token_ids[: seq.start + seq.num_tokens], f"corrupt KV for {request.request_id}"

    def drain(self, token: int | Callable[[Request], int] = TOKEN, max_steps: int = 1000) -> dict[str, Request]:
        """Step until nothing is left; every block must then be free. Returns all finished requests by id."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                break
            self.step(token)
        assert not self.scheduler.has_unfinished(), "scheduler did not finish"
        self.scheduler.block_manager.check_all_free()
        return self.finished


def sim(*requests: Request, **config) -> Sim:
    """A Sim over `make_scheduler(**config)` with `requests` queued in order."""
    scheduler = make_scheduler(**config)
    for request in requests:
        scheduler.add(request)
    return Sim(scheduler)


def prompt(length: int, start: int = 10) -> list[int]:
    return list(range(start, start + length))


# ---- token budget, chunking, batch composition ---------------------------------------------------------------


def test_token_budget_and_max_num_seqs_hold_every_step():
    """With more work than fits, a step fills the token budget but never exceeds it (Sim checks every step), and
    never holds more than max_num_seqs sequences; every request still gets all its tokens."""
    requests = [make_request(f"r{i}", prompt(5 + 3 * i, 10 * i), max_new_tokens=6) for i in range(8)]
    s = sim(*requests, num_blocks=64, max_batch_tokens=12, max_num_seqs=3)
    batch, _ = s.step()
    assert batch.num_tokens == 12 and len(batch.sequences) == 2  # 5 + 7 tokens
    sizes = [len(s.step()[0].sequences) for _ in range(10)]
    assert max(sizes) == 3
    outputs = s.drain()
    assert len(outputs) == 8 and all(r.num_output_tokens == 6 and r.finish_reason == "length" for r in outputs.values())


def test_chunked_prefill_gets_logits_only_on_its_last_chunk():
    """A 20-token prompt with an 8-token budget is computed in chunks 8 + 8 + 4; only the last chunk has a logits row
    and a sample, and the request then decodes one token per step."""
    request = make_request("r", prompt(20), max_new_tokens=3)
    s = sim(request, max_batch_tokens=8)
    chunks = []
    for _ in range(3):
        batch, _ = s.step()
        (seq,) = batch.sequences
        chunks.append((seq.start, seq.num_tokens, len(batch.logits_sequences), len(batch.samples)))
    assert chunks == [(0, 8, 0, 0), (8, 8, 0, 0), (16, 4, 1, 1)]
    assert request.num_computed_tokens == 20 and request.output_ids == [TOKEN]
    batch, _ = s.step()
    assert [(seq.start, seq.num_tokens) for seq in batch.sequences] == [(20, 1)]
    assert s.drain()["r"].output_ids == [TOKEN] * 3


def test_mixed_batch_of_decodes_and_a_prefill_chunk():
    """Running requests decode while a new long prompt is chunked into the same step with the leftover budget."""
    a, b = make_request("a", prompt(4), max_new_tokens=10), make_request("b", prompt(4, 50), max_new_tokens=10)
    s = sim(a, b, max_batch_tokens=8)
    s.step()  # both prompts in one step
    long = make_request("long", prompt(30, 100), max_new_tokens=2)
    s.scheduler.add(long)
    batch, _ = s.step()
    assert [(seq.request.request_id, seq.start, seq.num_tokens) for seq in batch.sequences] == [
        ("a", 4, 1),
        ("b", 4, 1),
        ("long", 0, 6),
    ]
    assert [r.request_id for r, _ in batch.samples] == ["a", "b"]  # the partial chunk gets no logits row
    assert batch.logits_sequences == [0, 1]
    outputs = s.drain()
    assert [outputs[i].num_output_tokens for i in ("a", "b", "long")] == [10, 10, 2]


def test_a_one_token_chunk_of_a_longer_prompt_is_not_a_decode():
    """A running request mid-prefill that gets a budget of one token computes that one token and samples nothing:
    a one-token chunk is not a decode (it gets no logits row), even when its block already has room for it."""
    a = make_request("a", prompt(2), max_new_tokens=12)
    s = sim(a, max_batch_tokens=2, block_size=4)
    s.step()  # a's prompt
    long = make_request("long", prompt(10, 100), max_new_tokens=2)
    s.scheduler.add(long)
    chunks = []
    while long.num_computed_tokens < 10:
        batch, _ = s.step()  # a decodes; long gets the one token left
        (seq,) = [seq for seq in batch.sequences if seq.request is long]
        chunks.append((seq.start, seq.num_tokens, long in [r for r, _ in batch.samples]))
    assert chunks == [(i, 1, i == 9) for i in range(10)]
    outputs = s.drain()
    assert [outputs[i].num_output_tokens for i in ("a", "long")] == [12, 2]


def test_fifo_decodes_first_prefill_first_admits_first():
    """With a budget too small for both: "fifo" gives the running request its decode token before the new prompt,
    "prefill_first" spends the whole budget on the new prompt and leaves the running request out of the step."""
    scheduled = {}
    for policy in ("fifo", "prefill_first"):
        old = make_request("old", prompt(4), max_new_tokens=4)
        s = sim(old, max_batch_tokens=4, policy=policy)
        s.step()
        s.scheduler.add(make_request("new", prompt(8, 50), max_new_tokens=2))
        batch, _ = s.step()
        scheduled[policy] = [(seq.request.request_id, seq.num_tokens) for seq in batch.sequences]
        assert {r.num_output_tokens for r in s.drain().values()} == {4, 2}
    assert scheduled == {"fifo": [("old", 1), ("new", 3)], "prefill_first": [("new", 4)]}


# ---- groups ------------------------------------------------------------------------------------------------------


def test_group_prefills_prompt_once_and_shares_its_blocks():
    """A group of 4 computes its prompt once: one sequence, one logits row, four samples on it, every prompt block
    with ref count 4. The shared partial block is copied on write (3 copies, the last owner keeps it), the full
    blocks stay shared, and all 4 samples finish with their own tokens."""
    leader = make_request("g", prompt(10), max_new_tokens=5, n=4)
    s = sim(leader, num_blocks=32, block_size=4)
    manager = s.scheduler.block_manager
    batch, _ = s.step()
    assert [(seq.request.request_id, seq.start, seq.num_tokens) for seq in batch.sequences] == [("g#0", 0, 10)]
    assert batch.logits_sequences == [0]
    assert [(r.request_id, row) for r, row in batch.samples] == [(f"g#{i}", 0) for i in range(4)]
    assert manager.num_used_blocks == 3  # 10 prompt tokens, stored once
    samples = [r for r, _ in batch.samples]
    full0, full1, partial = leader.block_ids
    assert all(r.block_ids == [full0, full1, partial] for r in samples)
    assert [manager.ref_counts[b] for b in leader.block_ids] == [4, 4, 4]

    batch, _ = s.step()
    assert len(batch.sequences) == 4 and sorted(src for src, _ in batch.block_copies) == [partial] * 3
    assert (manager.ref_counts[full0], manager.ref_counts[full1], manager.ref_counts[partial]) == (4, 4, 1)
    assert manager.num_used_blocks == 3 + 3
    outputs = s.drain(token=lambda r: 100 + r.sample_index)
    assert {i: r.output_ids for i, r in outputs.items()} == {f"g#{i}": [TOKEN, TOKEN] + [100 + i] * 3 for i in range(4)}


def test_group_uses_fewer_blocks_than_separate_requests():
    """n samples of one prompt hold the prompt's full blocks once; n separate requests hold n copies."""
    used = []
    for requests in (
        [make_request("g", prompt(16), max_new_tokens=2, n=4)],
        [make_request(f"r{i}", prompt(16), max_new_tokens=2) for i in range(4)],
    ):
        s = sim(*requests, num_blocks=64, block_size=4, prefix_caching=False)
        s.step()
        used.append(s.scheduler.block_manager.num_used_blocks)
        assert len(s.drain()) == 4
    assert used == [4, 16]


def test_prefix_cache_skips_computed_blocks_until_weights_change():
    """A repeated prompt starts after its cached full blocks; after a policy_version bump it is computed again."""
    s = sim(make_request("a", prompt(10)), block_size=4)
    s.drain()
    s.scheduler.add(make_request("b", prompt(10)))
    batch, _ = s.step()
    assert [(seq.start, seq.num_tokens) for seq in batch.sequences] == [(8, 2)]
    s.drain()
    s.scheduler.block_manager.policy_version += 1
    s.scheduler.add(make_request("c", prompt(10)))
    batch, _ = s.step()
    assert [(seq.start, seq.num_tokens) for seq in batch.sequences] == [(0, 10)]
    assert len(s.drain()) == 3


# ---- memory pressure -----------------------------------------------------------------------------------------


def test_preemption_recomputes_the_cheapest_request():
    """When decodes run out of blocks, the running request that loses the fewest tokens (here the newest: as many
    tokens, a later arrival) is preempted for recompute: back at the head of the waiting queue with no blocks and
    num_computed_tokens 0. Both still finish with all their tokens."""
    a, b = make_request("a", prompt(8), max_new_tokens=8), make_request("b", prompt(8, 50), max_new_tokens=8)
    s = sim(a, b, num_blocks=6, block_size=4)
    for _ in range(10):
        batch, _ = s.step()
        if batch.num_preempted:
            break
    assert batch.num_preempted == 1 and [seq.request for seq in batch.sequences] == [a]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert list(s.scheduler.waiting) == [b] and s.scheduler.num_preemptions == 1
    outputs = s.drain()
    assert outputs["a"].output_ids == outputs["b"].output_ids == [TOKEN] * 8


def test_preemption_swaps_when_swap_blocks_exist():
    """With CPU swap blocks, the victim's KV is swapped out (one (device, cpu) pair per block), then swapped back in
    from the same CPU blocks and resumes where it stopped, without recompute."""
    a, b = make_request("a", prompt(8), max_new_tokens=8), make_request("b", prompt(8, 50), max_new_tokens=8)
    s = sim(a, b, num_blocks=6, block_size=4, num_swap_blocks=8)
    manager = s.scheduler.block_manager
    for _ in range(10):
        device_blocks = list(b.block_ids)
        batch, _ = s.step()
        if batch.num_preempted:
            break
    assert b.status == RequestStatus.SWAPPED and b.block_ids == []
    assert [d for d, _ in batch.swap_out] == device_blocks and [c for _, c in batch.swap_out] == b.swap_block_ids
    assert len(manager.free_swap_blocks) == 8 - len(device_blocks)
    computed, cpu_blocks = b.num_computed_tokens, list(b.swap_block_ids)
    while not batch.swap_in:
        batch, _ = s.step()
    assert [c for c, _ in batch.swap_in] == cpu_blocks and [d for _, d in batch.swap_in] == b.block_ids[
        : len(cpu_blocks)
    ]
    assert [(seq.request, seq.start) for seq in batch.sequences] == [(b, computed)]
    assert len(manager.free_swap_blocks) == 8 and s.scheduler.num_swaps == 1
    outputs = s.drain()
    assert outputs["a"].output_ids == outputs["b"].output_ids == [TOKEN] * 8


def test_many_requests_under_pressure_all_finish():
    """A workload that needs several times the cache (groups included) finishes with every sample's full length,
    under both policies, with recompute and with swapping."""
    for policy in ("fifo", "prefill_first"):
        for swap in (0, 32):
            requests = [
                make_request(f"r{i}", prompt(3 + 5 * i, 20 * i), max_new_tokens=4 + 3 * i, n=1 + i % 3)
                for i in range(6)
            ]
            s = sim(*requests, num_blocks=12, block_size=4, max_batch_tokens=16, policy=policy, num_swap_blocks=swap)
            outputs = s.drain()
            assert len(outputs) == 12  # 1 + 2 + 3 + 1 + 2 + 3 samples
            assert all(o.num_output_tokens == o.max_new_tokens for o in outputs.values())
            assert s.scheduler.num_preemptions > 0


def test_request_that_can_never_fit_ends_with_error():
    """A group whose prompt + max_new_tokens needs more blocks than the cache has ends (all n samples) with
    finish_reason "error" and a message, without raising; the other request runs normally."""
    big = make_request("big", prompt(10), max_new_tokens=10, n=2)  # 20 tokens = 5 blocks > 4
    small = make_request("small", prompt(4, 50), max_new_tokens=4)
    s = sim(big, small, num_blocks=4, block_size=4)
    batch, finished = s.step()
    assert sorted(r.request_id for r in batch.finished) == ["big#0", "big#1"]
    assert all(r.finish_reason == "error" and "KV blocks" in r.error for r in finished)
    assert [seq.request.request_id for seq in batch.sequences] == ["small"]
    outputs = s.drain()
    assert outputs["small"].finish_reason == "length" and outputs["small"].num_output_tokens == 4


# ---- abort and stopping --------------------------------------------------------------------------------------


def test_abort_before_prompt_is_computed_ends_all_samples():
    """Aborting a queued group of 3 yields 3 finished samples with finish_reason "abort" and no output."""
    s = sim(make_request("g", prompt(8), n=3), make_request("other", prompt(8, 50)))
    ended = s.scheduler.abort("g")
    assert sorted(r.request_id for r in ended) == ["g#0", "g#1", "g#2"]
    assert all(r.is_finished and r.finish_reason == "abort" and r.output_ids == [] for r in ended)
    assert s.scheduler.abort("g") == []
    assert list(s.drain()) == ["other"]


def test_abort_mid_prefill_and_mid_decode():
    """abort() frees a group whose prompt is half computed (samples not yet forked) and a group that is decoding;
    the other request is unaffected."""
    s = sim(
        make_request("chunked", prompt(20), n=2),
        make_request("decoding", prompt(4, 50), n=2),
        make_request("other", prompt(4, 80), max_new_tokens=6),
        max_batch_tokens=12,
    )
    s.step()  # "chunked" gets 12 of 20 tokens
    ended = s.scheduler.abort("chunked")
    assert sorted((r.request_id, r.finish_reason) for r in ended) == [("chunked#0", "abort"), ("chunked#1", "abort")]
    s.step()
    s.step()
    ended = s.scheduler.abort("decoding")
    assert sorted((r.request_id, r.num_output_tokens) for r in ended) == [("decoding#0", 2), ("decoding#1", 2)]
    assert all(r.finish_reason == "abort" for r in ended)
    outputs = s.drain()
    assert list(outputs) == ["other"] and outputs["other"].num_output_tokens == 6


def test_stop_token_ends_request():
    """A stop token ends the request with "stop" (and is kept as its last output token)."""
    request = make_request("r", prompt(4), max_new_tokens=10, stop_token_ids=(STOP,))
    s = sim(request)
    outputs = s.drain(token=lambda r: STOP if r.num_output_tokens == 2 else TOKEN)
    assert outputs["r"].finish_reason == "stop" and outputs["r"].output_ids == [TOKEN, TOKEN, STOP]


def test_stop_token_ignored_before_min_new_tokens():
    """With min_new_tokens=3, stop tokens among the first outputs do not end the request; once 3 tokens were
    generated, the next stop token does."""
    request = make_request("r", prompt(4), max_new_tokens=10, stop_token_ids=(STOP,), min_new_tokens=3)
    s = sim(request)
    outputs = s.drain(token=lambda r: TOKEN if r.num_output_tokens == 2 else STOP)
    assert outputs["r"].finish_reason == "stop" and outputs["r"].output_ids == [STOP, STOP, TOKEN, STOP]


def test_stop_token_at_min_new_tokens_boundary_does_not_stop():
    """The sampler masks stop tokens while fewer than min_new_tokens tokens were generated, so the min_new_tokens-th
    output can never be a stop token; resolving it must agree and not stop there."""
    request = make_request("r", prompt(4), max_new_tokens=10, stop_token_ids=(STOP,), min_new_tokens=3)
    s = sim(request)
    outputs = s.drain(token=STOP)
    assert outputs["r"].output_ids == [STOP] * 4


def test_length_after_max_new_tokens():
    """Without a stop token a request ends with "length" after exactly max_new_tokens; a stop token sampled as the
    last allowed token reports "stop"."""
    a = make_request("a", prompt(4), max_new_tokens=5, stop_token_ids=(STOP,))
    b = make_request("b", prompt(4, 50), max_new_tokens=5, stop_token_ids=(STOP,))
    s = sim(a, b)
    outputs = s.drain(token=lambda r: STOP if r.request_id == "b" and r.num_output_tokens == 4 else TOKEN)
    assert (outputs["a"].finish_reason, outputs["a"].num_output_tokens) == ("length", 5)
    assert (outputs["b"].finish_reason, outputs["b"].num_output_tokens) == ("stop", 5)


# ---- regressions (bugs found and fixed) ------------------------------------------------------------------------------------------


def test_sample_forked_this_step_is_not_preempted():
    """Group g's leader finishes its prompt and forks g#1; r's chunk then runs out of blocks. The victim must not
    be g#1 (it gets a token this step); before the fix it was, and resolve() raised ValueError."""
    s = sim(
        make_request("g", prompt(7), max_new_tokens=1, n=2),
        make_request("r", prompt(7, 50), max_new_tokens=2),
        num_blocks=6,
        block_size=2,
        max_batch_tokens=4,
        policy="prefill_first",
    )
    outputs = s.drain()
    assert [outputs[i].num_output_tokens for i in ("g#0", "g#1", "r")] == [1, 1, 2]


def test_swap_in_and_swap_out_in_one_step_use_distinct_cpu_blocks():
    """prefill_first swaps r1 in, then r2's chunk preempts r2 to CPU in the same step. Swap-outs execute before
    swap-ins, so r2 must not be written into the CPU blocks r1 is being read from (Sim sees r1's KV corrupted)."""
    requests = [
        make_request("r0", prompt(6), max_new_tokens=5),
        make_request("r1", prompt(8, 50), max_new_tokens=4),
        make_request("r2", prompt(10, 80), max_new_tokens=1),
    ]
    s = sim(
        *requests,
        num_blocks=5,
        block_size=4,
        max_batch_tokens=4,
        max_num_seqs=4,
        policy="prefill_first",
        num_swap_blocks=16,
    )
    for _ in range(20):
        batch, _ = s.step()
        assert not {c for _, c in batch.swap_out} & {c for c, _ in batch.swap_in}
    s.drain()


def test_readmitted_request_is_not_the_next_victim():
    """r1 is preempted once (r2 is already in that step) and re-admitted behind r2; at the next shortage, caused by
    r2's decode, r2 is the victim (it loses fewer tokens than r1 and arrived later), not r1 again."""
    requests = [
        make_request("r0", prompt(7), max_new_tokens=1),
        make_request("r1", prompt(8, 50), max_new_tokens=3),
        make_request("r2", prompt(1, 80), max_new_tokens=5),
    ]
    s = sim(*requests, num_blocks=6, block_size=2, max_batch_tokens=3, policy="prefill_first")
    victims = []
    while s.scheduler.has_unfinished():
        running = list(s.scheduler.running)
        batch, _ = s.step()
        if batch.num_preempted:
            victims.append([r.request_id for r in running if r.status == RequestStatus.WAITING])
    assert victims == [["r1"], ["r2"]]
    s.drain()


# ---- clients take turns ----------------------------------------------------------------------------------------


def _from(client: str, request: Request) -> Request:
    request.client = client
    return request


def _admission_order(runner: Sim) -> list[str]:
    """Drain the scheduler, noting each request when it first computes."""
    order: list[str] = []
    while runner.scheduler.has_unfinished():
        batch, _ = runner.step()
        order += [seq.request.request_id for seq in batch.sequences if seq.request.request_id not in order]
    return order


def test_a_client_queued_behind_another_s_long_queue_gets_the_next_turn():
    """Client "a" queues 10 requests, then "b" one: with one sequence at a time, b's runs second, not eleventh. With
    one client the queue is in arrival order."""
    flood = [_from("a", make_request(f"a{i}", prompt(4, 10 + i), max_new_tokens=2)) for i in range(10)]
    runner = sim(*flood, _from("b", make_request("b0", prompt(4, 40), max_new_tokens=2)), max_num_seqs=1)
    order = _admission_order(runner)
    assert order.index("b0") == 1 and [rid for rid in order if rid != "b0"] == [f"a{i}" for i in range(10)]
    alone = sim(*(make_request(f"r{i}", prompt(4, 10 + i), max_new_tokens=2) for i in range(6)), max_num_seqs=1)
    assert _admission_order(alone) == [f"r{i}" for i in range(6)]


def test_a_client_that_cancelled_its_queue_is_not_put_behind_it():
    """Client "a" queued 8 requests and cancelled them; its next request takes its turn among "b"'s, not after the 8
    turns it gave up."""
    runner = sim(*(_from("a", make_request(f"a{i}", prompt(4, 10 + i), max_new_tokens=2)) for i in range(8)))
    runner.scheduler.abort(*(f"a{i}" for i in range(8)))
    assert "a" not in runner.scheduler.turns.newest
    for i in range(4):
        runner.scheduler.add(_from("b", make_request(f"b{i}", prompt(4, 30 + i), max_new_tokens=2)))
    runner.scheduler.add(_from("a", make_request("a-again", prompt(4, 50), max_new_tokens=2)))
    runner.scheduler.max_num_seqs = 1
    assert _admission_order(runner)[:2] == ["b0", "a-again"]
