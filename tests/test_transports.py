"""Weight transports as objects (`rollout.protocol.transports`): the registry names every transport once, each module
holds both halves of one interface, and a new transport is one module plus a registry line. The proof: a transport
written here (each bucket as one data frame, not one per piece), registered, carries a real push into a worker, whose
model then holds exactly the pushed weights."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import tiny_model
from rollout import ContinuousBatchingConfig
from rollout.protocol import WEIGHT_TRANSPORTS
from rollout.protocol import transports as registry
from rollout.protocol.transports.base import Receiver, Sender, StagingArea, UpdateRejected, WeightTransport
from rollout.protocol.transports.frames import _payload
from rollout.protocol.weight_messages import TensorPiece, WeightsBegin, WeightsBucket
from trainer_bridge import RolloutClient, push_weights


@pytest.mark.parametrize("name", WEIGHT_TRANSPORTS)
def test_every_registered_transport_is_one_module_with_both_halves(name):
    transport = registry.transport_named(name)
    assert isinstance(transport, WeightTransport) and transport.name == name
    assert issubclass(transport.sender, Sender) and transport.sender is not Sender
    assert issubclass(transport.receiver, Receiver) and transport.receiver is not Receiver
    assert transport.sender.send_bucket is not Sender.send_bucket  # each half does its own work
    assert transport.receiver.take_bytes is not Receiver.take_bytes


# ---- a transport written outside the package: each bucket as one data frame ------------------------------------
class OneFrameSender(Sender):
    def send_bucket(self, link, header: WeightsBucket, bucket, offsets):
        joined = torch.cat([data.cpu().reshape(-1) for _, _, data in bucket]) if bucket else torch.empty(0)
        joined = joined.to(torch.uint8).contiguous()
        self.push.channel.send(link.index, header, [memoryview(joined.numpy())])
        return joined


class OneFrameReceiver(Receiver):
    def accept_bucket(self, area: StagingArea, pieces: list[TensorPiece], frames: list) -> None:
        expected = sum(piece.nbytes for piece in pieces)
        if len(frames) != 1 or _payload(frames[0]).nbytes != expected:
            raise UpdateRejected("bad_update", "frames", f"one frame of {expected} bytes expected")
        area.announce(pieces)

    def take_bytes(self, area, begin: WeightsBegin, pieces, frames, checksum) -> None:
        data = torch.frombuffer(bytearray(_payload(frames[0])), dtype=torch.uint8)
        chunks, start = [], 0
        for piece in pieces:
            chunks.append(data[start : start + piece.nbytes])
            start += piece.nbytes
        area.verify(pieces, chunks, checksum)
        for piece, chunk in zip(pieces, chunks):
            area.stage(piece, chunk)


TRANSPORT = WeightTransport("one-frame", OneFrameSender, OneFrameReceiver)


@pytest.fixture
def in_process_worker():
    from rollout.engine.manager.continuous_batching import init_continuous_batching
    from rollout.service.zmq.worker import RolloutWorker

    manager = init_continuous_batching(tiny_model(), continuous_batching_config=ContinuousBatchingConfig(num_blocks=64))
    worker = RolloutWorker(manager, "tcp://127.0.0.1:*", "tiny")
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    try:
        yield worker, manager
    finally:
        worker.shutdown()
        thread.join(30)


def test_a_new_transport_is_one_module_and_a_registry_line(in_process_worker, monkeypatch):
    worker, manager = in_process_worker
    monkeypatch.setitem(registry.TRANSPORTS, "one-frame", __name__)
    target = tiny_model(seed=3)
    with RolloutClient(worker.address, timeout=60) as client:
        result = push_weights(client, target, transport="one-frame", bucket_bytes=4096)
    assert [entry["transport"] for entry in result.workers] == ["one-frame"]
    served = manager.engine.model.state_dict()
    for name, tensor in target.state_dict().items():
        assert torch.equal(served[name], tensor), name


def test_an_unregistered_transport_is_refused_by_name_on_both_sides(in_process_worker):
    from rollout import protocol as p

    worker, manager = in_process_worker
    with RolloutClient(worker.address, timeout=60) as client:
        with pytest.raises(ValueError, match="transport must be one of"):
            push_weights(client, tiny_model(seed=3), transport="one-frame")
    # A client that sends it anyway: the worker names the field.
    begin = p.WeightsBegin("u1", [p.TensorSpec("model.norm.weight", "float32", [8])], transport="one-frame")
    with RolloutClient(worker.address, timeout=60) as client:
        channel = client.open_update_channel("u1")
        try:
            channel.send(client.wait_connected()[0], begin)
            _, reply = channel.receive(30)
        finally:
            channel.close()
    assert isinstance(reply, p.Error) and reply.field == "transport", reply
    with RolloutClient(worker.address, timeout=60) as client:  # and keeps serving
        assert push_weights(client, tiny_model(seed=3)).version == 1
