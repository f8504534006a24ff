"""The weight-update slot in process (no sockets): work that grows with an update's size runs on the update's job
thread, not on the serving thread that must keep answering pings, and it runs in order, so a commit that arrives
before its buckets' acks still commits what they carried. torch.distributed rendezvous cannot pile up threads."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from slot_helpers import SLOW_S, open_slot, replies, timed

from rollout import protocol as p
from rollout.protocol import dist as dist_module
from rollout.protocol.staging import bucket_checksum
from rollout.service.weights import staged_update as weights_module

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def slot():
    with open_slot() as update_slot:
        yield update_slot


def test_hashing_and_the_nan_check_run_off_the_serving_thread_in_order(slot, monkeypatch):
    """With hashing and the finiteness check each taking SLOW_S, handling a bucket and the commit right after it
    (before the bucket's ack) returns at once; the ack, then the commit, arrive later, and the weights changed."""
    real_hash, real_tensors = weights_module.bucket_checksum, weights_module.StagedUpdate.tensors

    def slow_hash(chunks):
        time.sleep(SLOW_S)
        return real_hash(chunks)

    def slow_tensors(self, check_finite=False):
        time.sleep(SLOW_S)
        return real_tensors(self, check_finite)

    monkeypatch.setattr(weights_module, "bucket_checksum", slow_hash)
    monkeypatch.setattr(weights_module.StagedUpdate, "tensors", slow_tensors)
    slot.check_finite = True
    values = torch.full((64,), 3.0)
    data = values.view(torch.uint8)
    begin = p.WeightsBegin("u", [p.TensorSpec("model.norm.weight", "float32", [64])], version=7, partial=True)
    slot.handle(b"trainer", begin, [], None)
    assert isinstance(replies(slot, 1)[-1], p.WeightsReady)
    bucket = p.WeightsBucket("u", [p.TensorPiece(0, 0, 256)], bucket_checksum([data]))
    assert timed(lambda: slot.handle(b"trainer", bucket, [data.numpy().tobytes()], None)) < SLOW_S / 4
    assert timed(lambda: slot.handle(b"trainer", p.WeightsCommit("u"), [], None)) < SLOW_S / 4
    ack, committed = replies(slot, 3)[1:]
    assert isinstance(ack, p.WeightsAck) and ack.received_bytes == 256, ack
    assert isinstance(committed, p.WeightsCommitted) and committed.version == 7, committed
    assert torch.equal(slot.manager.engine.model.model.norm.weight.detach(), values)
    assert slot.update is None


def test_a_bucket_rejected_on_the_job_thread_ends_the_update_and_frees_the_slot(slot):
    """A wrong checksum is found on the job thread: the update is rejected (field "checksum") once the serving
    thread concludes it, nothing was applied, and a new update can begin."""
    before = slot.manager.engine.model.model.norm.weight.detach().clone()
    data = torch.full((64,), 5.0).view(torch.uint8)
    begin = p.WeightsBegin("bad", [p.TensorSpec("model.norm.weight", "float32", [64])], partial=True)
    slot.handle(b"trainer", begin, [], None)
    bucket = p.WeightsBucket("bad", [p.TensorPiece(0, 0, 256)], bucket_checksum([data]) ^ 1)
    slot.handle(b"trainer", bucket, [data.numpy().tobytes()], None)
    error = replies(slot, 2)[1]
    assert isinstance(error, p.Error) and (error.code, error.field) == ("bad_update", "checksum"), error
    assert slot.update is None and torch.equal(slot.manager.engine.model.model.norm.weight.detach(), before)
    slot.handle(b"trainer", p.WeightsBegin("next", begin.tensors, partial=True), [], None)
    assert isinstance(replies(slot, 3)[-1], p.WeightsReady)


@pytest.mark.parametrize("pieces", [[], [p.TensorPiece(0, 128, 0)]], ids=["no piece", "a piece of no bytes"])
def test_buckets_that_add_nothing_cannot_hold_the_slot(slot, pieces):
    """Every message of an update renews its phase deadline: a trainer sending buckets that add no bytes kept the
    slot from every other trainer for ever. A bucket must add bytes, or name a zero-size tensor for the first time."""
    data = torch.full((64,), 5.0).view(torch.uint8)
    spec = [p.TensorSpec("model.norm.weight", "float32", [64])]
    slot.handle(b"trainer", p.WeightsBegin("idle", spec, partial=True), [], None)
    assert isinstance(replies(slot, 1)[-1], p.WeightsReady)
    half = data[:128]
    slot.handle(b"trainer", p.WeightsBucket("idle", [p.TensorPiece(0, 0, 128)], bucket_checksum([half])),
                [half.numpy().tobytes()], None)  # fmt: skip
    assert isinstance(replies(slot, 2)[-1], p.WeightsAck)
    slot.handle(b"trainer", p.WeightsBucket("idle", pieces, bucket_checksum([])), [b""] * len(pieces), None)
    error = replies(slot, 3)[-1]
    assert isinstance(error, p.Error) and (error.code, error.field) == ("bad_update", "pieces"), error
    assert "adds no bytes" in error.message and slot.update is None


def test_more_buckets_than_may_wait_for_their_acks_reject_the_update(slot, monkeypatch):
    """A trainer keeps two buckets in flight; one that floods the job thread is refused by name."""
    monkeypatch.setattr(weights_module, "bucket_checksum", lambda chunks: time.sleep(SLOW_S) or 0)
    spec = [p.TensorSpec("model.norm.weight", "float32", [64])]
    slot.handle(b"trainer", p.WeightsBegin("flood", spec, partial=True), [], None)
    for index in range(6):
        piece = p.TensorPiece(0, index * 8, 8)
        slot.handle(b"trainer", p.WeightsBucket("flood", [piece], 0), [bytes(8)], None)
    errors = [m for m in slot.sent if isinstance(m, p.Error)]
    assert errors and errors[0].field == "pieces" and "wait for their acks" in errors[0].message, slot.sent


def test_four_buckets_sent_before_weights_ready_all_land(slot, monkeypatch):
    """The protocol lets 4 buckets wait for their acks, and a bucket sent before weights_ready still lands: while
    the staging area was still being made (seconds for a large model), that job counted as a waiting bucket, so the
    fourth bucket dropped the update ("more than 4 buckets wait for their acks") with only 3 waiting."""
    real_take = weights_module.StagedUpdate.take_staging

    def slow_take(self):
        time.sleep(SLOW_S)
        real_take(self)

    monkeypatch.setattr(weights_module.StagedUpdate, "take_staging", slow_take)
    values = torch.arange(64, dtype=torch.float32)
    data = values.view(torch.uint8)
    spec = [p.TensorSpec("model.norm.weight", "float32", [64])]
    slot.handle(b"trainer", p.WeightsBegin("early", spec, version=2, partial=True), [], None)
    for index in range(4):
        chunk = data[index * 64 : index * 64 + 64]
        bucket = p.WeightsBucket("early", [p.TensorPiece(0, index * 64, 64)], bucket_checksum([chunk]))
        slot.handle(b"trainer", bucket, [chunk.numpy().tobytes()], None)
    slot.handle(b"trainer", p.WeightsCommit("early"), [], None)
    sent = replies(slot, 6)
    assert [type(m).__name__ for m in sent] == ["WeightsReady", *["WeightsAck"] * 4, "WeightsCommitted"], sent
    assert torch.equal(slot.manager.engine.model.model.norm.weight.detach(), values)


def test_rendezvous_threads_are_bounded_when_stores_never_answer(monkeypatch):
    """Ten joins aimed at a port that accepts connections but never speaks the store's protocol (a rendezvous
    that would block until its timeout): at most MAX_RENDEZVOUS threads run; joins cancelled while waiting their
    turn never start one, and the running ones end within a retry interval of their update ending."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)  # the kernel accepts; nobody answers
    port = listener.getsockname()[1]
    receiver = dist_module.DistReceiver()
    cancelled = threading.Event()
    answers: list[BaseException | None] = []
    baseline = threading.active_count()
    try:
        for index in range(10):
            fields = {"host": "127.0.0.1", "port": port, "world_size": 2, "rank": 1, "backend": "gloo"}
            receiver.join({**fields, "group": f"g{index}"}, 3.0, answers.append, cancelled.is_set)
        assert threading.active_count() - baseline == dist_module.MAX_RENDEZVOUS
        cancelled.set()  # the updates ended: the six waiting joins are dropped
        deadline = time.monotonic() + 30
        while threading.active_count() > baseline:
            assert time.monotonic() < deadline, f"{threading.active_count() - baseline} rendezvous threads left"
            time.sleep(0.1)
        assert not answers  # cancelled joins answer nobody
        # Not cancelled: the silent listener is named as such after its update's timeout (torch's own store client
        # would wait for its answer forever).
        silent = threading.Event()
        receiver.join({**fields, "group": "alone"}, 2.0, lambda error: answers.append(error) or silent.set())
        assert silent.wait(10) and "does not answer as a torch.distributed store" in str(answers[0]), answers
    finally:
        receiver.close()
        listener.close()


def test_an_updates_later_replies_are_sent_for_its_clients_key(slot):
    """With CurveZMQ keys, replies an update sends later (a bucket's ack, the commit, a rejection found on the job
    thread) carry the key that began it, so the client links deliver them only while that key holds the routing id
    (another key may take a closed connection's routing id over: `test_auth_routing_ids.py`)."""
    data = torch.full((64,), 3.0).view(torch.uint8)
    spec = [p.TensorSpec("model.norm.weight", "float32", [64])]
    slot.handle(b"trainer", p.WeightsBegin("u", spec, version=3, partial=True), [], None, "K1")
    bucket = p.WeightsBucket("u", [p.TensorPiece(0, 0, 256)], bucket_checksum([data]))
    slot.handle(b"trainer", bucket, [data.numpy().tobytes()], None, "K1")
    slot.handle(b"trainer", p.WeightsCommit("u"), [], None, "K1")
    ready, ack, committed = replies(slot, 3)
    assert isinstance(ack, p.WeightsAck) and isinstance(committed, p.WeightsCommitted), (ack, committed)
    assert slot.sent_keys[1:] == ["K1", "K1"]
    slot.handle(b"trainer", p.WeightsBegin("bad", spec, partial=True), [], None, "K2")
    slot.handle(b"trainer", p.WeightsBucket("bad", bucket.pieces, bucket.checksum ^ 1), [data.numpy().tobytes()], None)
    error = replies(slot, 5)[-1]
    assert isinstance(error, p.Error) and error.field == "checksum" and slot.sent_keys[-1] == "K2"


@pytest.mark.parametrize(
    "fields",
    [{"version": 0}, {"mode": "bogus"}, {"timeout_s": 0.0}],
    ids=["version not above the current", "unknown mode", "no deadline"],
)
def test_a_refused_preempting_begin_leaves_the_open_update_of_another_trainer_alone(slot, fields):
    """A second trainer's weights_begin with preempt=True that is refused (a bad version, mode or deadline) changes
    nothing: it dropped the first trainer's open update before its own fields were checked, so one client's bad
    announcement poisoned another's transaction. The first update still takes its bucket and commits."""
    values = torch.full((64,), 2.0)
    data = values.view(torch.uint8)
    spec = [p.TensorSpec("model.norm.weight", "float32", [64])]
    slot.handle(b"first", p.WeightsBegin("kept", spec, version=4, partial=True), [], None)
    assert isinstance(replies(slot, 1)[-1], p.WeightsReady)
    intruder = {"version": 5, "partial": True, "preempt": True, **fields}
    slot.handle(b"second", p.WeightsBegin("intruder", spec, **intruder), [], None)
    refused = replies(slot, 2)[-1]
    assert isinstance(refused, p.Error) and refused.update_id == "intruder", slot.sent
    assert (refused.code, refused.field) == ("bad_update", next(iter(fields))), refused
    assert slot.update is not None and slot.update.update_id == "kept"
    bucket = p.WeightsBucket("kept", [p.TensorPiece(0, 0, 256)], bucket_checksum([data]))
    slot.handle(b"first", bucket, [data.numpy().tobytes()], None)
    slot.handle(b"first", p.WeightsCommit("kept"), [], None)
    ack, committed = replies(slot, 4)[2:]
    assert isinstance(ack, p.WeightsAck) and isinstance(committed, p.WeightsCommitted), slot.sent
    assert committed.version == 4 and torch.equal(slot.manager.engine.model.model.norm.weight.detach(), values)
