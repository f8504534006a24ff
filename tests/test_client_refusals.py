"""Refusals on the trainer side (`trainer_bridge`) that must leave everything else as it was, and come at once:

- a call refused as a duplicate `group_id` (generate, stream, generate_many, agenerate) does not cancel the group
  that holds the id: that one still runs to its length; one whose caller gave up on it (a timeout, a stream left
  early) does not hold it: a retry under its id runs;
- `stats()` on a closed client fails with "closed" at once, as `generate` does;
- `push_weights` refuses, before opening any update, a tensor whose dtype no transport carries (naming the tensor,
  its dtype and the dtypes carried), and a None client in a process that is not one rank of several;
- `WeightSyncCallback` refuses a bad mode or transport, `version` and unknown keywords when it is built, not at the
  first push after a training step;
- a sampling value holding an integer the wire cannot carry (a seed of 2**70) is refused naming its key
  (`sampling.seed`) and the range, not as "sampling values must be plain numbers" of field `sampling`.

One rollout-worker subprocess (tiny CPU model) serves the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rollout import FieldError, SamplingParams
from service_helpers import Worker
from trainer_bridge import Delta, GroupResult, PromptGroup, RolloutClient, RolloutError, push_weights

pytestmark = pytest.mark.timeout(120)
LONG = 300  # tokens of the group that holds the id: still running when the duplicate is refused
TENSOR = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def worker():
    server = Worker()
    yield server
    server.close()


@pytest.fixture
def client(worker):
    with RolloutClient(worker.address, timeout=60) as connection:
        yield connection


def _generate_many(client: RolloutClient, group: PromptGroup) -> None:
    list(client.generate_many([group], timeout=10))


def _agenerate(client: RolloutClient, group: PromptGroup) -> None:
    asyncio.run(client.agenerate(group, timeout=10))


DUPLICATE_CALLS = {
    "generate": lambda client, group: client.generate(group, timeout=10),
    "stream": lambda client, group: list(client.stream(group, timeout=10)),
    "generate_many": _generate_many,
    "agenerate": _agenerate,
}


@pytest.mark.parametrize("call", DUPLICATE_CALLS)
def test_a_refused_duplicate_id_leaves_the_group_holding_it_running(client, call):
    """The refused call used to cancel by id on its way out, aborting the first group (finish_reason "abort")."""
    group_id = f"held-{call}"
    first = client.stream(
        PromptGroup([1, 2, 3], sampling={"max_new_tokens": LONG, "min_new_tokens": LONG}, group_id=group_id)
    )
    assert isinstance(next(first), Delta)  # in flight on the worker
    with pytest.raises(RolloutError) as refused:
        DUPLICATE_CALLS[call](client, PromptGroup([1, 2, 3], sampling={"max_new_tokens": 4}, group_id=group_id))
    assert refused.value.code == "duplicate_group" and refused.value.field == "group_id"
    *_, result = first
    assert isinstance(result, GroupResult) and result.group_id == group_id
    assert [c.finish_reason for c in result.completions] == ["length"]
    assert len(result.completions[0].token_ids) == LONG


def _stream_a_little(client: RolloutClient, group: PromptGroup) -> None:
    stream = client.stream(group, timeout=10)
    next(stream)
    stream.close()  # leaving a stream early cancels its group


GAVE_UP = {
    "generate": lambda client, group: client.generate(group, timeout=0.3),
    "agenerate": lambda client, group: asyncio.run(client.agenerate(group, timeout=0.3)),
    "stream": _stream_a_little,
}


@pytest.mark.parametrize("gave_up", GAVE_UP)
def test_a_retry_under_the_id_of_a_group_its_caller_gave_up_on_runs(client, worker, gave_up):
    """A call that timed out (or a stream left early) cancels its group; a retry under the same id at once used to
    be refused with duplicate_group while the worker had not answered the cancel yet. It runs, to its whole length,
    the tokens of the same greedy group under another id, and the given-up run is cancelled on the worker."""
    settings = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": LONG}
    expected = client.generate(PromptGroup([4, 5, 6], sampling=settings)).completions[0].token_ids
    group = PromptGroup([4, 5, 6], sampling=settings, group_id=f"again-{gave_up}")
    with pytest.raises(RolloutError, match="timeout") if gave_up != "stream" else contextlib.nullcontext():
        GAVE_UP[gave_up](client, group)
    result = client.generate(group)
    assert result.group_id == group.group_id and result.completions[0].token_ids == expected
    deadline = time.monotonic() + 30
    while worker.stats()["groups_in_flight"]:
        assert time.monotonic() < deadline, "the given-up run kept running"
        time.sleep(0.05)


def test_stats_on_a_closed_client_fails_at_once(worker):
    """It waited for its workers first (10 s) and only then said "closed"."""
    connection = RolloutClient(worker.address)
    connection.close()
    started = time.monotonic()
    with pytest.raises(RolloutError) as refused:
        connection.stats()
    assert refused.value.code == "closed"
    assert time.monotonic() - started < 1.0


def test_wait_connected_on_a_closed_client_fails_at_once(worker):
    """It returned [] (no live worker), as if none had answered."""
    connection = RolloutClient(worker.address)
    connection.close()
    with pytest.raises(RolloutError) as refused:
        connection.wait_connected()
    assert refused.value.code == "closed"


@pytest.mark.parametrize("call", ["wait_connected", "stats", "update_channel"])
def test_a_wait_in_flight_when_the_client_closes_fails_with_closed_at_once(call):
    """`close()` says calls still waiting fail with RolloutError: wait_connected returned [] as if no worker had
    answered, and stats and a weight update's receive (push_weights) waited out their whole timeout, then said
    "timeout". The workers here never answer (nothing listens at their ports)."""
    from service_helpers import free_port

    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    connection = RolloutClient(addresses, connect_timeout=60)
    waits = {
        "wait_connected": lambda: connection.wait_connected(30),
        "stats": lambda: connection.stats(30),
        "update_channel": lambda: connection.open_update_channel("u1").receive(30),
    }
    timer = threading.Timer(0.3, connection.close)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(RolloutError) as ended:
            waits[call]()
    finally:
        timer.join()
        connection.close()
    assert ended.value.code == "closed" and time.monotonic() - started < 5


@pytest.mark.parametrize("call", ["add_worker", "remove_worker"])
def test_a_membership_change_the_closing_client_never_took_fails_with_closed_at_once(call, monkeypatch):
    """A change handed to the I/O thread just as the client closes is never taken (the thread ended): it waited out
    its timeout, then said the I/O thread "did not take" the address. The lost hand-over is made certain here."""
    from service_helpers import free_port

    connection = RolloutClient(f"tcp://127.0.0.1:{free_port()}")
    monkeypatch.setattr(connection._io, "command", lambda command: None)  # the thread ends before taking it
    timer = threading.Timer(0.3, connection.close)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(RolloutError) as ended:
            getattr(connection, call)(f"tcp://127.0.0.1:{free_port()}", timeout=30)
    finally:
        timer.join()
        connection.close()
    assert ended.value.code == "closed" and time.monotonic() - started < 5


@pytest.mark.parametrize("timeout", [-1, float("nan"), "10"])
def test_a_waits_timeout_that_cannot_work_is_refused_by_name(client, timeout):
    """wait_connected(timeout=nan) returned at once, as if timed out; stats(timeout=nan) failed with "timeout"
    naming the worker; a string was a TypeError."""
    for call in (lambda: client.wait_connected(timeout), lambda: client.stats(timeout)):
        with pytest.raises(RolloutError) as refused:
            call()
        assert (refused.value.code, refused.value.field) == ("bad_request", "timeout")
    assert client.wait_connected() == [0] and client.stats()


def test_wait_connected_for_ever_waits_as_long_as_connect_timeout_lets_it(client):
    """math.inf had always waited until connect_timeout (its deadline bounds the wait): the timeout check refused it
    as "no number of seconds", a trainer's wait_connected(math.inf) failing with bad_request."""
    assert client.wait_connected(float("inf")) == [0]


def _no_update_opened(client: RolloutClient, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The update ids `client` opens a channel for from now on (a push's first step, before it sends anything)."""
    opened: list[str] = []
    original = client.open_update_channel
    monkeypatch.setattr(
        client, "open_update_channel", lambda update_id: opened.append(update_id) or original(update_id)
    )
    return opened


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint32])
def test_a_tensor_of_a_dtype_no_transport_carries_is_refused_by_name(client, monkeypatch, dtype):
    """It failed with a bare KeyError: 'complex64' after asking the workers for their tensors."""
    from rollout.presets import tiny_model

    shape = tiny_model().state_dict()[TENSOR].shape  # the worker's own: only the dtype is wrong
    opened = _no_update_opened(client, monkeypatch)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(FieldError) as refused:
        push_weights(client, {TENSOR: torch.zeros(shape, dtype=dtype)}, partial=True)
    assert refused.value.field == TENSOR
    assert f"dtype {name} cannot be pushed" in refused.value.reason
    assert "float32" in refused.value.reason and "bfloat16" in refused.value.reason  # the dtypes carried
    assert opened == [] and client.min_policy_version == 0


def test_a_none_client_in_a_single_process_is_refused_by_name(monkeypatch):
    """push_weights(None, ...) returned None, pushing nothing: None is for the other ranks of a distributed job."""
    weights = {TENSOR: torch.zeros(4, 4)}
    with pytest.raises(FieldError) as refused:
        push_weights(None, weights)
    assert refused.value.field == "client" and "this process is alone" in refused.value.reason
    with pytest.raises(FieldError, match="^client: "):  # an accelerator of one process
        push_weights(None, weights, accelerator=SimpleNamespace(num_processes=1, is_main_process=True))

    # A rank other than the main one of several: gathers, sends nothing, returns None.
    assert push_weights(None, weights, accelerator=SimpleNamespace(num_processes=2, is_main_process=False)) is None
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args: 2)
    assert push_weights(None, weights) is None
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args: 1)
    with pytest.raises(FieldError, match="^client: "):
        push_weights(None, weights)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"mode": "bogus"}, ValueError, "mode must be one of .* got 'bogus'"),
        ({"transport": "x"}, ValueError, "transport must be one of .* got 'x'"),
        ({"version": 5}, TypeError, "^version: WeightSyncCallback sets it"),
        ({"bogus_kw": 1}, TypeError, "^bogus_kw: push_weights takes no 'bogus_kw'"),
    ],
)
def test_weight_sync_callback_refuses_bad_settings_when_built(kwargs, error, message):
    """They were accepted, and failed at the first on_step_end, after a whole training step."""
    from trainer_bridge.weights.sync_callback import WeightSyncCallback

    with pytest.raises(error, match=message):
        WeightSyncCallback(None, **kwargs)
    good = WeightSyncCallback(None, every=2, mode="wait", transport="frames", bucket_bytes=1 << 20, timeout=5.0)
    assert good.push_kwargs == {"mode": "wait", "transport": "frames", "bucket_bytes": 1 << 20, "timeout": 5.0}


@pytest.mark.parametrize(
    "sampling, field, message",
    [
        (
            {"seed": 2**70},
            "sampling.seed",
            f"sampling.seed: must be an integer in [-2**63, 2**64) on the wire, got {2**70}",
        ),
        ({"seed": -(2**64)}, "sampling.seed", "sampling.seed: must be an integer in [-2**63, 2**64) on the wire, got "),
        (
            {"max_new_tokens": 4, "stop_token_ids": [1, 2**70]},
            "sampling.stop_token_ids",
            "sampling.stop_token_ids: holds an integer outside [-2**63, 2**64), the integers the wire carries",
        ),
        ({"temperature": 2**70}, "sampling.temperature", f"sampling.temperature: {2**70} is outside [-2**63, 2**64)"),
    ],
)
def test_an_integer_the_wire_cannot_carry_is_refused_naming_its_sampling_field(client, sampling, field, message):
    """msgpack cannot write an integer outside [-2**63, 2**64): the client refused any such value as "sampling values
    must be plain numbers/strings/lists: int too big to convert" with field `sampling`; it names the value's key as
    the worker names sampling fields (`sampling.seed`), with the range (the seed in the worker's own words)."""
    for given in (sampling, SamplingParams(**sampling)):  # a dict, or the same fields as a SamplingParams
        with pytest.raises(RolloutError) as refused:
            client.generate(PromptGroup([1, 2], 1, given), timeout=10)
        assert refused.value.code == "bad_request" and refused.value.field == field, given
        assert f"bad_request: {message}" in str(refused.value)
    assert client.generate(PromptGroup([1, 2], 1, {"seed": 2**64 - 1, "max_new_tokens": 2}), timeout=30).completions


@pytest.mark.parametrize(
    "kwargs",
    [{"timeout": -1}, {"timeout": float("nan")}, {"timeout": "300"}, {"timeout": float("inf")}, {"heartbeat_s": 0},
     {"heartbeat_s": -1}, {"dead_after_s": -1}, {"dead_after_s": "x"}, {"connect_timeout": "20"}],
)  # fmt: skip
def test_client_settings_that_cannot_work_are_refused_by_name(kwargs):
    """A timeout of -1 once made every call fail at once ("no answer in time") from a live worker, "300" a TypeError at
    the first call, and heartbeat_s=0 or -1 an idle client that pings its workers in a loop, a core busy."""
    (name,) = kwargs
    with pytest.raises(ValueError, match=f"^{name}: must be a positive number of seconds"):
        RolloutClient("tcp://127.0.0.1:9", **kwargs)


@pytest.mark.parametrize("slack", ["4", True, -1, float("nan")])
def test_an_affinity_slack_that_is_no_count_is_refused_by_name(slack):
    """affinity_slack="4" was a TypeError from a comparison; a bool was taken as 0 or 1."""
    with pytest.raises(ValueError, match="^affinity_slack: must be >= 0 or None"):
        RolloutClient("tcp://127.0.0.1:9", affinity_slack=slack)


@pytest.mark.parametrize("timeout", [-1, 0, float("nan"), "10"])
def test_a_calls_timeout_that_cannot_work_is_refused_by_name(client, timeout):
    group = PromptGroup([1, 2, 3], sampling={"max_new_tokens": 4})
    for call in (
        lambda: client.generate(group, timeout=timeout),
        lambda: list(client.stream(group, timeout=timeout)),
        lambda: list(client.generate_many([group], timeout=timeout)),
    ):
        with pytest.raises(RolloutError) as refused:
            call()
        assert (refused.value.code, refused.value.field) == ("bad_request", "timeout")
    assert client.generate(group).completions  # the client goes on


def test_generate_many_yields_a_group_whose_id_came_again_after_the_first_finished(client, worker):
    """A lazy iterable that repeats an id once the group holding it finished: the client takes the second group (its
    id is free again); generate_many once ended at the first result of that id, so the second was never yielded,
    never refused, and ran on for nobody."""

    def finished() -> int:
        return sum(worker.stats()["samples_finished"].values())

    def groups():
        before = finished()
        yield PromptGroup([5, 6, 7], group_id="again", sampling={"max_new_tokens": 4, "stop_token_ids": []})
        deadline = time.monotonic() + 30
        while finished() == before and time.monotonic() < deadline:  # the first one finished
            time.sleep(0.05)
        while "again" in client._io.router.calls and time.monotonic() < deadline:  # and its result reached the client
            time.sleep(0.01)
        yield PromptGroup([6, 6, 7], group_id="again", sampling={"max_new_tokens": 200, "stop_token_ids": []})
        yield PromptGroup([7, 6, 7], group_id="other", sampling={"max_new_tokens": 4, "stop_token_ids": []})

    results = list(client.generate_many(groups(), timeout=60))
    assert sorted(r.prompt_ids for r in results) == [[5, 6, 7], [6, 6, 7], [7, 6, 7]]
    assert worker.stats()["groups_in_flight"] == 0
