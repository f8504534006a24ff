"""Unloading a pushed LoRA adapter over ZeroMQ (`unload_adapter(client, name)`), against a real rollout-worker
subprocess with one adapter slot (`--max-loras 1`): the freed slot serves another adapter, whose greedy tokens equal
peft's own generate of it; the unloaded adapter's groups in flight end with finish_reason "abort" while the base's
go on; the policy version does not move; what cannot be unloaded is refused by name, on the wire too."""

from __future__ import annotations

import os
import signal
import threading
import time

import msgpack
import pytest
from lora_models import lora_model, peft_greedy

from rollout import protocol as p
from service_helpers import Client, Worker
from trainer_bridge import Delta, PromptGroup, RolloutClient, RolloutError, push_weights, unload_adapter

pytestmark = pytest.mark.timeout(180)

PROMPT = [(37 * i + 5) % 101 for i in range(37)]
GREEDY = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": 12}
LONG = {"max_new_tokens": 1500, "stop_token_ids": []}


@pytest.fixture(scope="module")
def worker():
    server = Worker("--max-loras", "1", "--max-lora-rank", "8")
    yield server
    server.close()


@pytest.fixture
def client(worker):
    with RolloutClient(worker.address, timeout=60) as connection:
        yield connection
    with RolloutClient(worker.address, timeout=60) as cleanup:  # the next test starts with the slot free
        for name in cleanup.stats()[0]["adapters"]:
            unload_adapter(cleanup, name)


def test_an_unloaded_adapters_slot_serves_another(client):
    alice, bob = lora_model(1), lora_model(2)
    pushed = push_weights(client, alice, adapter_name="alice")
    with pytest.raises(RolloutError) as error:  # the one slot is taken
        push_weights(client, bob, adapter_name="bob")
    assert error.value.field == "max_loras" and "trainer_bridge.unload_adapter" in str(error.value)
    assert client.adapter == "alice"  # its groups sample with the adapter it pushed ...
    assert unload_adapter(client, "alice") == 0
    assert client.adapter is None  # ... and with the base once it is unloaded
    (stats,) = client.stats()
    assert stats["adapters"] == {} and stats["policy_version"] == pushed.version  # no served weights changed
    with pytest.raises(RolloutError) as error:
        client.generate(PromptGroup(PROMPT, sampling=GREEDY, adapter="alice"))
    assert error.value.field == "adapter"
    again = push_weights(client, bob, adapter_name="bob")
    for completion in client.generate(PromptGroup(PROMPT, n=2, sampling=GREEDY, adapter="bob")).completions:
        assert completion.token_ids == peft_greedy(bob, PROMPT)
        assert (completion.adapter, completion.adapter_version) == ("bob", again.version)


def test_an_unload_ends_the_adapters_groups_in_flight_and_the_base_goes_on(client):
    push_weights(client, lora_model(3), adapter_name="carol")
    events = iter(client.stream(PromptGroup(PROMPT, n=2, sampling=LONG, adapter="carol")))
    assert isinstance(next(events), Delta)  # its first tokens: it runs
    base: dict = {}
    thread = threading.Thread(
        target=lambda: base.update(result=client.generate(PromptGroup(PROMPT, sampling=GREEDY, adapter="__base__")))
    )
    thread.start()
    assert unload_adapter(client, "carol") == 2
    *_, result = events
    assert [c.finish_reason for c in result.completions] == ["abort", "abort"]
    thread.join(timeout=60)
    (completion,) = base["result"].completions
    assert completion.finish_reason == "length" and len(completion.token_ids) == 12


def test_what_cannot_be_unloaded_is_refused_by_name(client, worker):
    push_weights(client, lora_model(4), adapter_name="dave")
    for name in ("", None, 3):
        with pytest.raises(RolloutError) as error:
            unload_adapter(client, name)
        assert (error.value.code, error.value.field) == ("bad_request", "adapter_name")
    for timeout in (0, -1, True, "5"):
        with pytest.raises(RolloutError) as error:
            unload_adapter(client, "dave", timeout=timeout)
        assert error.value.field == "timeout"
    with pytest.raises(RolloutError) as error:  # not served: named, with what is
        unload_adapter(client, "eve")
    assert (error.value.code, error.value.field) == ("bad_request", "adapter_name")
    assert "no worker serves an adapter named 'eve'" in str(error.value) and "served: ['dave']" in str(error.value)
    with pytest.raises(RolloutError) as error:
        unload_adapter(client, "__base__")
    assert error.value.field == "adapter_name" and "the base model, which is never unloaded" in str(error.value)
    assert client.stats()[0]["adapters"].keys() == {"dave"}  # nothing refused changed what is served
    raw = Client(worker.address)
    try:  # on the wire: the answer carries the update_id it was sent with
        reply = raw.ask(p.AdapterUnload("u-1", "eve"))
        assert (reply.TYPE, reply.code, reply.field, reply.update_id) == ("error", "bad_request", "adapter", "u-1")
        header = {"protocol": p.PROTOCOL_VERSION, "type": "adapter_unload", "update_id": "u-2", "adapter": 5}
        raw.socket.send_multipart([msgpack.packb(header)])
        reply = raw.receive()
        assert (reply.code, reply.field, reply.update_id) == ("bad_request", "adapter", "u-2")
        reply = raw.ask(p.AdapterUnload("u-3", "dave"))
        assert (reply.TYPE, reply.update_id, reply.adapter, reply.aborted) == ("adapter_unloaded", "u-3", "dave", 0)
    finally:
        raw.close()
    client.close()
    with pytest.raises(RolloutError) as error:
        unload_adapter(client, "dave")
    assert error.value.code == "closed"


def test_an_unload_a_stopped_worker_cannot_answer_ends_in_time_and_is_carried_out_later(worker, client):
    """The worker stopped (SIGSTOP): the unload times out naming it, and one whose client is closed meanwhile says so
    at once (it waited out its timeout); once the worker goes on, it carries the unload out (as documented)."""
    push_weights(client, lora_model(5), adapter_name="frank")
    os.kill(worker.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RolloutError) as error:
            unload_adapter(client, "frank", timeout=1)
        assert error.value.code == "timeout" and worker.address in str(error.value)
        outcome: dict = {}

        def unload() -> None:
            started = time.monotonic()
            try:
                unload_adapter(client, "frank", timeout=30)
            except RolloutError as failure:
                outcome.update(code=failure.code, seconds=time.monotonic() - started)

        thread = threading.Thread(target=unload)
        thread.start()
        time.sleep(0.3)
        client.close()
        thread.join(10)
        assert outcome["code"] == "closed" and outcome["seconds"] < 3, outcome
    finally:
        os.kill(worker.process.pid, signal.SIGCONT)
    with RolloutClient(worker.address, timeout=60) as later:
        deadline = time.monotonic() + 30
        while "frank" in later.stats()[0]["adapters"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "frank" not in later.stats()[0]["adapters"]
