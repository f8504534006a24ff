"""RolloutClient against real rollout-worker subprocesses: generate/stream/generate_many (sync and asyncio),
errors with timeouts, thread safety, balancing, and failover when a worker is killed mid-run."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import pytest

from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch
from rollout.presets import tiny_model
from service_helpers import Worker, free_port
from trainer_bridge import Delta, GroupResult, PromptGroup, RolloutClient, RolloutError

pytestmark = pytest.mark.timeout(180)
GREEDY = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": 10}


@pytest.fixture(scope="module")
def workers():
    servers = Worker.several(2)
    yield servers
    for server in servers:
        server.close()


@pytest.fixture
def client(workers):
    with RolloutClient([w.address for w in workers], timeout=60) as connection:
        yield connection


def test_generate_equals_in_process_engine(client):
    prompt = list(range(10, 30))
    result = client.generate(PromptGroup(prompt, n=4, sampling=GREEDY))
    expected = generate_batch(
        tiny_model(),
        [prompt],
        progress_bar=False,
        n=4,
        sampling=SamplingParams(**GREEDY),
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=256, block_size=16),
    )
    assert isinstance(result, GroupResult) and result.prompt_ids == prompt
    assert [c.token_ids for c in result.completions] == [expected[f"req_0#{i}"].generated_tokens for i in range(4)]


def test_stream_and_generate_many_and_async(client):
    sampling = {"temperature": 1.0, "seed": 3, "stop_token_ids": [], "max_new_tokens": 8}
    events = list(client.stream(PromptGroup([4, 5, 6], n=2, sampling=sampling)))
    result = events[-1]
    assert isinstance(result, GroupResult) and all(isinstance(e, Delta) for e in events[:-1])
    for completion in result.completions:
        streamed = [t for e in events[:-1] if e.sample_index == completion.sample_index for t in e.token_ids]
        assert streamed == completion.token_ids
    again = client.generate(PromptGroup([4, 5, 6], n=2, sampling=sampling))
    assert [c.token_ids for c in again.completions] == [c.token_ids for c in result.completions]  # same seed

    groups = [PromptGroup([i, i + 1, i + 2], n=2, sampling=GREEDY, group_id=f"many-{i}") for i in range(6)]
    assert sorted(r.group_id for r in client.generate_many(groups)) == sorted(g.group_id for g in groups)

    async def run():
        single = await client.agenerate(PromptGroup([9, 9], sampling=GREEDY))
        streamed = [e async for e in client.astream(PromptGroup([9, 9], sampling=GREEDY))]
        many = [r async for r in client.agenerate_many([PromptGroup([1, 2], sampling=GREEDY)] * 3)]
        return single, streamed, many

    single, streamed, many = asyncio.run(run())
    assert streamed[-1].completions[0].token_ids == single.completions[0].token_ids
    assert len(many) == 3


def test_errors_name_the_field_and_timeouts_never_hang(client):
    with pytest.raises(RolloutError) as raised:
        client.generate(PromptGroup([1, 2, 99999], sampling=GREEDY))
    assert raised.value.code == "bad_request" and raised.value.field == "prompt_ids"
    with pytest.raises(RolloutError) as raised:
        client.generate(PromptGroup([1, 2], sampling={**GREEDY, "max_new_tokens": 1800}), timeout=0.2)
    assert raised.value.code == "timeout"
    with RolloutClient("tcp://127.0.0.1:9", timeout=0.5) as nobody:  # nothing listens there
        with pytest.raises(RolloutError):
            nobody.generate(PromptGroup([1, 2], sampling=GREEDY))


def test_safe_from_many_threads_and_balanced(client):
    results, errors = [], []

    def work(offset):
        try:
            for i in range(4):
                results.append(client.generate(PromptGroup([offset, i, 7], n=2, sampling=GREEDY)).group_id)
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(set(results)) == 24
    served = [s["generated_tokens"] for s in client.stats()]
    assert len(served) == 2 and all(count > 0 for count in served)  # both workers got work


def test_failover_when_a_worker_is_killed():
    """Two workers; one is SIGKILLed while both are generating. Every group completes exactly once, full length,
    and the survivor generated the dead worker's groups too."""
    long = 200  # tokens per sample
    survivor, victim = Worker.several(2)
    try:
        with RolloutClient([survivor.address, victim.address], timeout=120, heartbeat_s=0.2, dead_after_s=1.5) as c:
            assert len(c.stats()) == 2  # both answered: the groups are balanced over both, none waits for a worker
            groups = [
                PromptGroup([i, 2, 3], n=2, sampling={**GREEDY, "max_new_tokens": long}, group_id=f"f{i}")
                for i in range(8)
            ]
            results = c.generate_many(groups)
            gathered = threading.Thread(target=lambda: collected.extend(results))
            collected: list[GroupResult] = []
            gathered.start()
            deadline = time.monotonic() + 60
            # Killed as soon as it is generating its share (waiting for both workers to be seen busy at once could
            # miss a worker that already finished).
            while not any(s["address"] == victim.address and s["running"] > 0 for s in c.stats()):
                assert time.monotonic() < deadline, "the victim never got busy"
            victim.process.send_signal(signal.SIGKILL)
            gathered.join(150)
            assert not gathered.is_alive()
            (survivor_stats,) = c.stats()  # only the live worker answers
            # With every worker gone, a call waits for one to come back up to its timeout; the timeout then names
            # each worker, and how it was lost (a trainer whose only worker died read "no group finished in time").
            survivor.process.send_signal(signal.SIGKILL)
            deadline = time.monotonic() + 30
            while c.live_workers() and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(RolloutError) as waited:
                c.generate(PromptGroup([1, 2, 3], sampling=GREEDY), timeout=1.0)
            assert waited.value.code == "timeout" and "no rollout worker serves" in str(waited.value)
            for lost in (victim, survivor):
                assert f"{lost.address}: lost " in str(waited.value)
            assert "its connection closed" in str(waited.value)
        assert sorted(r.group_id for r in collected) == sorted(g.group_id for g in groups)  # each exactly once
        assert all(len(comp.token_ids) == long for r in collected for comp in r.completions)
        assert survivor_stats["generated_tokens"] == 8 * 2 * long  # its own 4 groups plus the 4 resubmitted
    finally:
        survivor.close()
        victim.close()


def test_input_is_checked_in_the_callers_thread(client):
    """numpy ids are accepted; float ids, a duplicate in-flight id or an unpackable sampling value are refused at
    once naming the field, and the client keeps working afterwards."""
    np = pytest.importorskip("numpy")
    result = client.generate(PromptGroup(np.array([1, 2, 3]), sampling={**GREEDY, "temperature": np.float32(1.0)}))
    assert len(result.completions[0].token_ids) == 10
    for group, field in [
        (PromptGroup([1.0, 2.0], sampling=GREEDY), "prompt_ids"),
        (PromptGroup([1, 2], sampling={"seed": {1, 2}}), "sampling.seed"),  # the key msgpack cannot write
        (PromptGroup([1, 2], n="2", sampling=GREEDY), "n"),
    ]:
        with pytest.raises(RolloutError) as raised:
            client.generate(group, timeout=5)
        assert raised.value.field == field
    long = PromptGroup([1, 2], sampling={**GREEDY, "max_new_tokens": 1000}, group_id="twice")
    stream = client.stream(long)
    next(stream)
    with pytest.raises(RolloutError) as raised:
        client.generate(long, timeout=5)
    assert raised.value.code == "duplicate_group"
    stream.close()  # leaving a stream early cancels its group on the worker
    deadline = time.monotonic() + 30
    while any(s["groups_in_flight"] for s in client.stats()):
        assert time.monotonic() < deadline, "the abandoned stream's group kept running"
        time.sleep(0.1)
    assert client.generate(PromptGroup([5, 6], sampling=GREEDY)).completions[0].finish_reason == "length"


def test_client_built_before_its_worker_starts():
    """A client may start before its worker: calls wait (within their timeout) until the worker answers."""
    from service_helpers import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    with RolloutClient(address, timeout=120, heartbeat_s=0.2, dead_after_s=0.5) as early:
        time.sleep(1.0)  # long enough to be declared dead
        server = Worker(address=address)
        try:
            assert early.generate(PromptGroup([1, 2, 3], sampling=GREEDY)).completions[0].finish_reason == "length"
        finally:
            server.close()


def test_asyncio_calls_do_not_need_a_thread_each(client):
    """24 concurrent agenerate calls are all in flight at once (no thread-pool cap), and a cancelled task cancels
    its group on the worker."""

    async def run():
        groups = [PromptGroup([i, 1], sampling={**GREEDY, "max_new_tokens": 300}) for i in range(24)]
        tasks = [asyncio.create_task(client.agenerate(g)) for g in groups]
        await asyncio.sleep(0.5)
        in_flight = sum(s["groups_in_flight"] for s in client.stats())
        results = await asyncio.gather(*tasks)
        slow = asyncio.create_task(client.agenerate(PromptGroup([3, 3], sampling={**GREEDY, "max_new_tokens": 1500})))
        await asyncio.sleep(0.5)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        return in_flight, results

    in_flight, results = asyncio.run(run())
    assert in_flight == 24 and len(results) == 24
    deadline = time.monotonic() + 30
    while any(s["groups_in_flight"] for s in client.stats()):
        assert time.monotonic() < deadline, "the cancelled task's group kept running"
        time.sleep(0.1)


def test_trainer_bridge_does_not_import_the_engine():
    """The trainer side imports only the protocol from rollout: no torch, transformers or engine."""
    import subprocess
    import sys

    code = "import sys, trainer_bridge; bad = [m for m in ('torch', 'transformers', 'rollout.engine') if m in sys.modules]; print(bad)"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"


def test_weight_sync_does_not_import_the_engine_or_transformers_models():
    """Pushing weights needs torch and the wire contract, not the engine nor transformers' models."""
    import subprocess
    import sys

    code = (
        "import sys, trainer_bridge.weights.weight_sync; "
        "print([m for m in ('rollout.engine', 'transformers.models') if any(k.startswith(m) for k in sys.modules)])"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"


@pytest.mark.timeout(180)
def test_groups_sent_before_the_worker_is_up_are_never_dropped():
    """Issue 14: 1,500 groups submitted to a worker that is not up yet overflowed the socket's send queue (1,000
    messages) and a third of them were silently dropped. All of them must come back, once."""
    address = f"tcp://127.0.0.1:{free_port()}"
    groups = [
        PromptGroup([1 + i % 50, 2], 1, {"do_sample": False, "max_new_tokens": 1, "stop_token_ids": []}, f"q{i}")
        for i in range(1500)
    ]
    with RolloutClient(address, timeout=150, dead_after_s=120) as client:
        results = {}
        collector = threading.Thread(
            target=lambda: results.update((r.group_id, r) for r in client.generate_many(groups))
        )
        collector.start()
        time.sleep(1.0)  # every group is queued in the client before the worker exists
        worker = Worker(address=address)
        try:
            collector.join(150)
        finally:
            worker.close()
    assert sorted(results) == sorted(g.group_id for g in groups)
    assert all(len(r.completions[0].token_ids) == 1 for r in results.values())


def test_generate_cancels_its_group_when_the_wait_ends_early(client):
    """Issue 14: Ctrl-C (or any exception) during generate() left the group running on the worker; it is cancelled
    on the way out, so the workers stop generating for it (8 x 2000 tokens would keep them busy for seconds)."""
    group = PromptGroup([1, 2, 3], 8, {"do_sample": False, "max_new_tokens": 2000, "stop_token_ids": []})
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C while generate() waits
    with pytest.raises(KeyboardInterrupt):
        client.generate(group, timeout=60)
    time.sleep(1.0)  # the cancel lands within a step or two
    before = sum(s["generated_tokens"] for s in client.stats())
    time.sleep(1.0)
    assert sum(s["generated_tokens"] for s in client.stats()) == before
    assert all(s["running"] == 0 and s["queued"] == 0 for s in client.stats())


@pytest.mark.parametrize(
    "group, field",
    [
        (PromptGroup([2**64]), "prompt_ids"),
        (PromptGroup([1], n=2**64), "n"),
        (PromptGroup([1], group_id="\udc80"), "group_id"),
        (PromptGroup([1], group_id="g" * (2**20 + 1)), "group_id"),  # the worker could not read it to answer
    ],
)
def test_values_msgpack_cannot_carry_are_refused_and_the_client_lives_on(client, group, field):
    """Review finding: such a group raised inside the I/O thread, which died and failed every call of the client."""
    with pytest.raises(RolloutError) as error:
        client.generate(group)
    assert (error.value.code, error.value.field) == ("bad_request", field)
    assert client.generate(PromptGroup([5, 6], sampling=GREEDY)).completions[0].finish_reason == "length"


@pytest.mark.parametrize("address", ["tcp://localhost:abc", "tcp://127.0.0.1:", "ipc://"])
def test_a_malformed_address_is_named_as_such(address):
    with pytest.raises(ValueError, match="addresses"):
        RolloutClient(address)


def test_a_sampling_params_is_sent_like_its_dict_and_checked_by_the_workers_rules(client):
    """PromptGroup.sampling takes a rollout.SamplingParams too: the same completion as the dict of its fields; a
    misspelled or invalid field is refused in the caller's thread by the worker's own check, naming it."""
    as_dict = client.generate(PromptGroup([5, 6, 7], sampling={**GREEDY, "seed": 3}))
    params = SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=10, seed=3)
    as_params = client.generate(PromptGroup([5, 6, 7], sampling=params))
    assert as_params.completions[0].token_ids == as_dict.completions[0].token_ids
    for sampling, field in [({"temprature": 1.0}, "sampling.temprature"), ({"top_p": 2.0}, "sampling.top_p")]:
        with pytest.raises(RolloutError) as raised:
            client.generate(PromptGroup([1, 2], sampling=sampling))
        assert raised.value.field == field, raised.value


def test_workers_added_and_removed_while_groups_run(workers):
    """A client of worker A takes worker B in while running; removing A with groups in flight resubmits them to B:
    every group comes back once, equal to the in-process engine (greedy, seeded)."""
    a, b = (w.address for w in workers)
    expected = generate_batch(
        tiny_model(),
        [[9, 8, 7]],
        progress_bar=False,
        sampling=SamplingParams(**{**GREEDY, "max_new_tokens": 120}),
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=256, block_size=16),
    )["req_0"].generated_tokens
    with RolloutClient([a], timeout=120) as client:
        client.add_worker(b)
        client.add_worker(b)  # already there: nothing
        assert client.worker_addresses == [a, b]
        assert len(client.stats()) == 2
        groups = [PromptGroup([9, 8, 7], n=2, sampling={**GREEDY, "max_new_tokens": 120}) for _ in range(6)]
        results, removed = [], False
        for result in client.generate_many(groups):
            results.append(result)
            if not removed:
                client.remove_worker(a)
                removed = True
        assert len({r.group_id for r in results}) == len(results) == len(groups)  # each exactly once
        assert all(c.token_ids == list(expected) for r in results for c in r.completions)
        assert client.worker_addresses == [b] and [s["address"] for s in client.stats()] == [b]
        client.remove_worker("tcp://127.0.0.1:1")  # not one of its workers: nothing
        with pytest.raises(ValueError, match="address"):
            client.add_worker("127.0.0.1:5555")


def test_no_group_goes_to_a_worker_behind_the_newest_pushed_version(workers):
    """Workers serving weights older than the newest version pushed through the client get no group; calls wait, and
    fail naming the stale workers after connect_timeout."""
    with RolloutClient([w.address for w in workers], timeout=30, connect_timeout=1.5) as client:
        assert len(client.stats()) == 2
        client.min_policy_version = 10**6  # as if a push had reached other workers
        started = time.monotonic()
        with pytest.raises(RolloutError, match="older than version 1000000") as refused:
            client.generate(PromptGroup([1, 2, 3], sampling=GREEDY))
        assert refused.value.code == "stale_workers" and time.monotonic() - started < 10
        client.min_policy_version = 0
        assert client.generate(PromptGroup([1, 2, 3], sampling=GREEDY)).completions[0].token_ids


def test_calls_wait_while_every_worker_is_replaced(workers):
    """All of a client's workers removed (a fleet whose workers all restart) long after connect_timeout: calls wait for
    the next worker to be added instead of failing with no_workers; an address ZeroMQ refuses leaves the client up."""
    a, b = (w.address for w in workers)
    with RolloutClient([a], timeout=60, connect_timeout=0.5) as client:
        assert len(client.stats()) == 1
        time.sleep(0.7)
        client.remove_worker(a)
        waiting = threading.Thread(target=lambda: done.append(client.generate(PromptGroup([4, 5], sampling=GREEDY))))
        done: list[GroupResult] = []
        waiting.start()
        time.sleep(1.0)
        assert not done and waiting.is_alive()  # parked, not failed
        with pytest.raises(ValueError, match="port"):
            client.add_worker("tcp://127.0.0.1:*")
        client.add_worker(b)
        waiting.join(60)
        assert done and len(done[0].completions[0].token_ids) == GREEDY["max_new_tokens"]
        assert client.worker_addresses == [b]


@pytest.mark.parametrize("affinity", [True, False])
def test_a_later_turn_goes_to_the_worker_that_holds_its_prefix(workers, affinity):
    """An agent's next turn extends its last prompt: with affinity (the default) it goes to the worker that served
    that prompt although the other one is idler, and its prompt's first blocks come from that worker's prefix cache
    (the Completion's cached_prompt_tokens); by load alone (affinity_slack=None) it goes to the idle worker, which
    computes the whole prompt."""
    slack = {} if affinity else {"affinity_slack": None}
    settings = {"max_new_tokens": 4, "stop_token_ids": [], "temperature": 0}
    turn = [(7 * i + 2) % 900 + 4 for i in range(40)]
    with RolloutClient([w.address for w in workers], timeout=60, **slack) as client:
        # both workers answered first: load-only routing ties go to the first, so the second must be known by then
        assert client.wait_connected() == [0, 1]
        first = client.generate(PromptGroup(turn, sampling=settings)).completions[0]
        later = turn + first.token_ids + [5, 6, 7]  # the completion, then a tool result
        busy = PromptGroup([9, 9, 9], sampling={**settings, "max_new_tokens": 8})  # to the first turn's worker
        results = {
            r.group_id: r for r in client.generate_many([busy, PromptGroup(later, group_id="t2", sampling=settings)])
        }
        cached = results["t2"].completions[0].cached_prompt_tokens
    assert cached == (32 if affinity else 0), cached


def test_a_restarted_worker_gets_no_group_before_it_says_which_weights_it_serves():
    """A worker restarts after a push (back on its start weights) while a call waits for it: the call is not sent
    there on the old version the client knew (the worker's first pong says 0), and fails naming the stale worker."""
    from trainer_bridge import push_weights

    worker = Worker()
    try:
        with RolloutClient(worker.address, timeout=30, connect_timeout=1.5) as client:
            assert push_weights(client, tiny_model(seed=1)).version == 1
            worker.close()
            deadline = time.monotonic() + 20
            while client.live_workers():
                assert time.monotonic() < deadline, "the client never saw the worker go"
                time.sleep(0.05)
            outcome: list = []

            def call() -> None:
                try:
                    outcome.append(client.generate(PromptGroup([1, 2, 3], sampling=GREEDY)))
                except RolloutError as error:
                    outcome.append(error)

            waiting = threading.Thread(target=call)
            waiting.start()  # parked: no worker answers
            worker = Worker(address=worker.address)
            waiting.join(30)
            assert isinstance(outcome[0], RolloutError) and outcome[0].code == "stale_workers", outcome
            assert worker.stats()["generated_tokens"] == 0
    finally:
        worker.close()


def test_a_group_id_with_a_hash_is_refused_by_the_client_and_a_long_one_is_not_echoed_whole():
    """The client refuses '#' in a group id (the worker would: its reply echoed a long id whole, past what the client
    reads, and the call waited out its timeout); the engine's refusal shows at most 64 characters of it."""
    from conftest import make_engine
    from conftest import tiny_model as tiny_causal_lm
    from rollout.config import FieldError, SamplingParams
    from trainer_bridge.client.calls import checked_group

    with pytest.raises(RolloutError, match="group_id must not contain '#'") as refused:
        checked_group(PromptGroup([1, 2], group_id="#" + "x" * 1000), lambda: 1, lambda: "g")
    assert refused.value.field == "group_id"
    engine = make_engine(tiny_causal_lm())
    try:
        with pytest.raises(FieldError) as named:
            engine.add_request("#" + "x" * (1 << 20), [1, 2], SamplingParams(max_new_tokens=1))
        assert named.value.field == "group_id" and len(str(named.value)) < 200
    finally:
        engine.close()


def test_a_worker_bound_to_an_ipv6_address_serves_the_client():
    """rollout-worker --bind tcp://[::1]:PORT (it loaded the model, then failed on the bind) and a client of it."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    worker = Worker(address=f"tcp://[::1]:{port}", wait=False)
    try:
        with RolloutClient(worker.address, timeout=60) as client:
            assert len(client.generate(PromptGroup([1, 2, 3], sampling=GREEDY)).completions[0].token_ids) > 0
    finally:
        worker.close()


def test_cancel_without_a_group_id_is_refused_by_name():
    """cancel(None) returned at once, cancelling nothing (a group streamed without an id keeps None in the caller's
    PromptGroup): refused, saying where the id is."""
    with RolloutClient("tcp://127.0.0.1:1", timeout=1) as client:
        for bad in (None, "", 7):
            with pytest.raises(RolloutError, match="cancel needs a group's id") as refused:
                client.cancel(bad)
            assert refused.value.field == "group_id"


def test_a_push_below_the_newest_version_pushed_through_the_client_is_refused():
    """Workers restarted at 0 would take version 1 after 5 was pushed, and no call would go to them again (the
    client waits for workers at its newest version): refused before anything is sent, saying what to push."""
    from rollout.config import FieldError
    from trainer_bridge import push_weights

    with RolloutClient("tcp://127.0.0.1:1", timeout=1) as client:
        client.min_policy_version = 5
        with pytest.raises(FieldError, match="version: 1 is below 5, the newest version pushed through this client"):
            push_weights(client, tiny_model(), version=1)
        with pytest.raises(FieldError, match="adapter_name: must be a non-empty string"):  # "" became "default"
            push_weights(client, tiny_model(), adapter_name="")


def test_a_worker_that_never_answered_is_said_once_by_the_error_or_by_a_warning(caplog):
    """No worker at the address: a call fails with no_workers naming it, and the log does not say it a second time;
    an idle client, which no error tells, warns once."""
    silent = f"tcp://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="trainer_bridge.client.liveness"):
        with RolloutClient(silent, timeout=30, heartbeat_s=0.2, connect_timeout=0.5) as client:
            with pytest.raises(RolloutError, match=f"{silent}: no answer within 0.5 s") as refused:
                client.generate(PromptGroup([1, 2, 3], sampling=GREEDY))
            assert refused.value.code == "no_workers"
            time.sleep(0.6)
        assert "never answered" not in caplog.text
        with RolloutClient(silent, timeout=30, heartbeat_s=0.2, connect_timeout=0.5):
            time.sleep(1.2)
    warnings = [record for record in caplog.records if "never answered" in record.getMessage()]
    assert len(warnings) == 1 and silent in warnings[0].getMessage()


def test_stats_names_a_live_worker_that_does_not_answer(workers):
    """One of two workers stopped (SIGSTOP), not declared dead yet: stats() names it, where it once said only "a
    worker did not answer stats in time" (and AsyncRollouts, reading its base_version, "no live rollout worker")."""
    answering, stopped = workers
    with RolloutClient([w.address for w in workers], timeout=60, dead_after_s=60) as client:
        assert len(client.stats()) == 2
        stopped.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(RolloutError, match=f"no answer from {stopped.address} \\(live") as raised:
                client.stats(timeout=2)
            assert raised.value.code == "timeout" and answering.address not in str(raised.value)
        finally:
            stopped.process.send_signal(signal.SIGCONT)
        assert len(client.stats()) == 2


def test_a_timeout_names_the_stopped_worker_its_groups_wait_on(workers):
    """One of two workers stopped (SIGSTOP), not declared dead yet: a call whose group waits on it times out naming
    that worker and that it does not answer pings, where it once said only "no group finished in time" (sync and
    asyncio); the worker that answers is not named."""
    answering, stopped = workers
    with RolloutClient([w.address for w in workers], timeout=60, heartbeat_s=0.2, dead_after_s=60) as client:
        assert client.wait_connected() == [0, 1]
        stopped.process.send_signal(signal.SIGSTOP)
        try:
            groups = [PromptGroup([1, 2, i], sampling=GREEDY) for i in range(4)]  # spread over both workers
            stuck = f"waiting on {stopped.address} \\(it has not answered pings"
            with pytest.raises(RolloutError, match=stuck) as raised:
                list(client.generate_many(groups, timeout=2))
            assert raised.value.code == "timeout" and answering.address not in str(raised.value)

            async def gathered() -> None:
                async for _ in client.agenerate_many([PromptGroup([3, 4, i], sampling=GREEDY) for i in range(8)], 2):
                    pass

            with pytest.raises(RolloutError, match=stuck):  # (the stopped worker still holds those: 8 reach it too)
                asyncio.run(gathered())
        finally:
            stopped.process.send_signal(signal.SIGCONT)
        assert len(client.stats()) == 2


def test_a_cancelled_groups_waiter_gets_its_abort_when_no_worker_answers_the_cancel(workers):
    """`cancel` promises the waiter the group aborted. A group waiting for a worker (every one behind the newest
    weights), or whose worker stopped answering (SIGSTOP) before it answered the cancel, was dropped without a word:
    its waiter waited out its whole timeout, even when the worker came back and answered the cancel."""
    long = {**GREEDY, "max_new_tokens": 1500}

    def waited(client: RolloutClient, group_id: str, cancel) -> tuple[float, list[str]]:
        answer: list = []
        group = PromptGroup([1, 2, 3], n=2, sampling=long, group_id=group_id)
        waiter = threading.Thread(target=lambda: answer.append(client.generate(group)))
        started = time.monotonic()
        waiter.start()
        cancel()
        waiter.join(40)
        return time.monotonic() - started, [c.finish_reason for result in answer for c in result.completions]

    with RolloutClient([w.address for w in workers], timeout=30, heartbeat_s=0.2, dead_after_s=1.5) as client:
        assert len(client.stats()) == 2
        client.min_policy_version = 10**6  # parked: no worker serves the newest weights

        def cancel_parked():
            time.sleep(0.5)
            client.cancel("parked")

        seconds, reasons = waited(client, "parked", cancel_parked)
        assert reasons == ["abort", "abort"] and seconds < 10
        client.min_policy_version = 0
        stopped = []

        def cancel_on_a_stopped_worker():
            deadline = time.monotonic() + 20
            while not (busy := [s["address"] for s in client.stats() if s["running"]]):
                assert time.monotonic() < deadline
            stopped.append(next(w for w in workers if w.address == busy[0]))
            stopped[0].process.send_signal(signal.SIGSTOP)
            client.cancel("stopped")
            time.sleep(3)
            stopped[0].process.send_signal(signal.SIGCONT)  # back: it answers the cancel

        try:
            seconds, reasons = waited(client, "stopped", cancel_on_a_stopped_worker)
        finally:
            for worker in stopped:
                worker.process.send_signal(signal.SIGCONT)
        assert reasons == ["abort", "abort"] and seconds < 15


def test_a_long_heartbeat_does_not_leave_groups_to_the_workers_client_timeout(monkeypatch):
    """A worker cancels the groups of a client silent for its --client-timeout (30 s by default), and the client's
    pings are all it sends while it waits: with heartbeat_s above that, every long group came back "abort", with no
    error. The client pings at least every MAX_PING_GAP_S (5 s; 0.5 here, against a worker's timeout of 1.5 s)
    whatever heartbeat_s says."""
    from trainer_bridge.client import rollout_client

    monkeypatch.setattr(rollout_client, "MAX_PING_GAP_S", 0.5, raising=False)
    silence = 1.5  # (the client's loop wakes every half gap: a ping may come that much late)
    server = Worker("--client-timeout", str(silence))
    try:
        with RolloutClient(server.address, timeout=120, heartbeat_s=60, dead_after_s=120) as client:
            started = time.monotonic()
            sampling = {"max_new_tokens": 1000, "stop_token_ids": [], "seed": 1}
            completion = client.generate(PromptGroup([1, 2, 3], sampling=sampling)).completions[0]
            assert time.monotonic() - started > silence, "the group ended before the worker's timeout"
            assert (completion.finish_reason, len(completion.token_ids)) == ("length", 1000), completion.finish_reason
    finally:
        server.close()
