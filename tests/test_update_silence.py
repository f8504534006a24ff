"""A trainer's open weight update is bounded by its own phase deadline (`timeout_s`), not by the worker's
--client-timeout, which is for groups in flight: a trainer connected and silent for longer than --client-timeout,
within its update's deadline, keeps its update (it was dropped as "the client is gone"; with the defaults, an update
of timeout_s 60 was dropped after 30 s of silence). A vanished trainer still loses its update at once."""

from __future__ import annotations

import time

import numpy as np
import pytest

from rollout import protocol as p
from service_helpers import Client, Worker

pytestmark = pytest.mark.timeout(60)
CLIENT_TIMEOUT_S = 1.0
SILENCE_S = 3 * CLIENT_TIMEOUT_S


@pytest.fixture(scope="module")
def worker():
    server = Worker("--client-timeout", str(CLIENT_TIMEOUT_S))
    yield server
    server.close()


def _norm(client: Client) -> p.TensorSpec:
    spec = client.ask(p.WeightsSpec("spec"))
    return next(tensor for tensor in spec.tensors if tensor.name == "model.norm.weight")


def _bucket(client: Client, update_id: str, tensor: p.TensorSpec) -> None:
    data = np.full(tensor.shape, 1.0, np.float32).tobytes()
    client.socket.send_multipart([*p.encode(p.WeightsBucket(update_id, [p.TensorPiece(0, 0, len(data))])), data])


def test_an_update_outlives_a_silence_longer_than_the_client_timeout(worker):
    client = Client(worker.address)
    try:
        tensor = _norm(client)
        begin = p.WeightsBegin("quiet", [tensor], partial=True, timeout_s=30)
        assert isinstance(client.ask(begin), p.WeightsReady)
        with pytest.raises(TimeoutError):  # nothing comes meanwhile: no "update_timeout"
            client.receive(timeout_s=SILENCE_S)
        _bucket(client, "quiet", tensor)
        assert isinstance(client.receive(), p.WeightsAck)
        committed = client.ask(p.WeightsCommit("quiet"))
        assert isinstance(committed, p.WeightsCommitted), committed
    finally:
        client.close()


def test_a_silent_trainers_groups_end_and_its_update_stays(worker):
    """Silence still cancels a client's groups (their result comes, aborted); the update it has open goes on."""
    client = Client(worker.address)
    try:
        tensor = _norm(client)
        sampling = {"do_sample": False, "stop_token_ids": [], "max_new_tokens": 1500}
        client.send(p.Generate("long", [1, 2, 3], sampling=sampling))
        begin = p.WeightsBegin("beside", [tensor], partial=True, timeout_s=30)
        assert isinstance(client.ask(begin), p.WeightsReady)
        started = time.monotonic()
        result = client.receive(timeout_s=30)  # nothing sent: the group is cancelled for the silence
        assert isinstance(result, p.GroupResult) and result.completions[0].finish_reason == "abort", result
        assert time.monotonic() - started < SILENCE_S + 5
        _bucket(client, "beside", tensor)
        assert isinstance(client.receive(), p.WeightsAck)
        assert isinstance(client.ask(p.WeightsAbort("beside")), p.WeightsAck)
    finally:
        client.close()


def test_a_vanished_trainer_still_frees_the_update_slot(worker):
    first, second = Client(worker.address), Client(worker.address)
    try:
        tensor = _norm(first)
        assert isinstance(first.ask(p.WeightsBegin("gone", [tensor], partial=True, timeout_s=30)), p.WeightsReady)
        first.close()
        deadline = time.monotonic() + 10
        while True:  # its connection closed: the slot is free within a second or so, not after 30 s
            reply = second.ask(p.WeightsBegin("next", [tensor], partial=True, timeout_s=30))
            if isinstance(reply, p.WeightsReady):
                break
            assert reply.code == "update_in_progress" and time.monotonic() < deadline, reply
            time.sleep(0.2)
        assert isinstance(second.ask(p.WeightsAbort("next")), p.WeightsAck)
    finally:
        second.close()
