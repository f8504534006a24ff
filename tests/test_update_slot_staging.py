"""A weight update's staging area (a host buffer, or a shared segment whose pages are reserved and, on a GPU,
page-locked: seconds for a large model) is made on the update's job thread, never on the serving thread: the
weights_begin returns at once and weights_ready comes once the area exists. Areas are made one at a time; an update
that ended meanwhile gives its area back before the next is made; a failure is answered by name; the worker's own
time is not the client's phase deadline; nothing queued behind a failed area touches it; and a dead update never
takes a torch.distributed group from the live one that replaced it."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid

import pytest
import torch
from slot_helpers import SLOW_S, open_slot, replies, timed

from rollout import protocol as p
from rollout.protocol import staging as staging_module
from rollout.protocol.dist import make_process_group, make_store
from rollout.protocol.staging import bucket_checksum
from rollout.service.weights.update_slot import UpdateSlot

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def slot():
    with open_slot() as update_slot:
        yield update_slot


SPEC = [p.TensorSpec("model.norm.weight", "float32", [64])]


def _serve(slot: UpdateSlot, seconds: float, until=lambda: False) -> None:
    """The serving loop's part for `seconds` (or until `until()`): conclude finished steps, expire deadlines."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not until():
        slot.conclude()
        slot.expire(time.monotonic())
        time.sleep(0.01)


def test_the_staging_area_is_made_off_the_serving_thread_and_a_bucket_sent_early_still_lands(slot, monkeypatch):
    """Making the staging area takes SLOW_S (a multi-GB shared segment's pages reserved and page-locked): the
    weights_begin returns at once and weights_ready comes once the area exists; a bucket and the commit sent before
    it (frames) wait behind it and commit."""
    real_host = slot._staging.host

    def slow_host(nbytes):
        time.sleep(SLOW_S)
        return real_host(nbytes)

    monkeypatch.setattr(slot._staging, "host", slow_host)
    values = torch.full((64,), 4.0)
    data = values.view(torch.uint8)
    begin = p.WeightsBegin("early", [p.TensorSpec("model.norm.weight", "float32", [64])], version=3, partial=True)
    assert timed(lambda: slot.handle(b"trainer", begin, [], None)) < SLOW_S / 4
    bucket = p.WeightsBucket("early", [p.TensorPiece(0, 0, 256)], bucket_checksum([data]))
    slot.handle(b"trainer", bucket, [data.numpy().tobytes()], None)
    slot.handle(b"trainer", p.WeightsCommit("early"), [], None)
    assert not slot.sent  # nothing is ready yet
    ready, ack, committed = replies(slot, 3)
    assert isinstance(ready, p.WeightsReady) and ready.staging_bytes == 256, ready
    assert isinstance(ack, p.WeightsAck) and isinstance(committed, p.WeightsCommitted) and committed.version == 3
    assert torch.equal(slot.manager.engine.model.model.norm.weight.detach(), values)


def test_a_staging_area_that_cannot_be_made_rejects_the_begin_by_transport(slot, monkeypatch):
    """/dev/shm too small for the segment: the begin is answered with an error naming the transport (the push
    falls back to frames on it), and the slot is free for the next update."""

    def no_room(nbytes):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(slot._staging, "shared", no_room)
    made = []
    host = slot._staging.host
    monkeypatch.setattr(slot._staging, "host", lambda nbytes: made.append(host(nbytes)) or made[-1])
    spec = [p.TensorSpec("model.norm.weight", "float32", [64])]
    slot.handle(b"trainer", p.WeightsBegin("shm", spec, partial=True, transport="shm"), [], None)
    error = replies(slot, 1)[0]
    assert isinstance(error, p.Error) and (error.code, error.field) == ("bad_update", "transport"), error
    assert "No space left" in error.message and slot.update is None
    slot.handle(b"trainer", p.WeightsBegin("frames", spec, partial=True), [], None)
    assert isinstance(replies(slot, 2)[-1], p.WeightsReady)
    # The host buffer the shm update took went back to the pool: the frames update has it again.
    assert len(made) == 2 and made[1].data_ptr() == made[0].data_ptr()


def test_an_area_whose_allocation_raises_is_answered_and_frees_the_slot(slot, monkeypatch):
    """A page-locked host buffer that cannot be allocated (RuntimeError, not a refusal of ours): the client hears
    "internal" naming it at once, and the slot is free."""

    def fail(nbytes):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(slot._staging, "host", fail)
    slot.handle(b"trainer", p.WeightsBegin("oom", SPEC, partial=True, timeout_s=30), [], None)
    _serve(slot, 5.0, lambda: bool(slot.sent))
    error = slot.sent[0]
    assert isinstance(error, p.Error) and (error.code, error.field) == ("internal", "transport"), error
    assert "out of memory" in error.message and slot.update is None


def test_buckets_and_commit_behind_a_failed_area_touch_nothing(slot, monkeypatch, caplog):
    """/dev/shm full; a bucket and the commit arrive before the serving thread concluded the error: their jobs do
    nothing (no exception on the job thread), and the one reply is the transport's error."""

    def no_room(nbytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(slot._staging, "shared", no_room)
    caplog.set_level(logging.ERROR, logger="rollout.service.weights.jobs")
    slot.handle(b"trainer", p.WeightsBegin("s", SPEC, partial=True, transport="shm"), [], None)
    slot.handle(b"trainer", p.WeightsBucket("s", [p.TensorPiece(0, 0, 256)], None), [], None)
    slot.handle(b"trainer", p.WeightsCommit("s"), [], None)
    time.sleep(0.5)  # the three jobs ran
    _serve(slot, 0.3)
    assert [type(m).__name__ for m in slot.sent] == ["Error"] and slot.sent[0].field == "transport", slot.sent
    assert not [record for record in caplog.records if record.exc_info]


def test_the_workers_own_staging_time_is_not_the_clients_phase_deadline(slot, monkeypatch):
    """Making the segment takes longer than the client's timeout_s: the update is not expired meanwhile; the
    deadline runs from weights_ready on."""
    real = slot._staging.shared
    monkeypatch.setattr(slot._staging, "shared", lambda nbytes: time.sleep(2 * SLOW_S) or real(nbytes))
    begin = p.WeightsBegin("slow", SPEC, partial=True, transport="shm", timeout_s=1.5 * SLOW_S)
    slot.handle(b"trainer", begin, [], None)
    _serve(slot, 4 * SLOW_S, lambda: bool(slot.sent))
    assert isinstance(slot.sent[0], p.WeightsReady), slot.sent
    _serve(slot, 2 * SLOW_S, lambda: len(slot.sent) > 1)  # then the client's silence does count
    assert isinstance(slot.sent[-1], p.Error) and slot.sent[-1].code == "update_timeout", slot.sent


def test_begin_and_abort_in_a_loop_makes_one_area_at_a_time(slot, monkeypatch):
    """Twenty begin/abort pairs while reserving a segment's pages takes SLOW_S: one reservation at a time (not
    twenty update-sized segments at once), and none is left in /dev/shm."""
    real_fallocate, live, lock = os.posix_fallocate, {"now": 0, "peak": 0}, threading.Lock()

    def slow_fallocate(fd, offset, nbytes):
        with lock:
            live["now"] += 1
            live["peak"] = max(live["peak"], live["now"])
        time.sleep(SLOW_S)
        try:
            return real_fallocate(fd, offset, nbytes)
        finally:
            with lock:
                live["now"] -= 1

    fake_os = type(os)("fake_os")
    fake_os.posix_fallocate = slow_fallocate
    monkeypatch.setattr(staging_module, "os", fake_os)
    made: list[str] = []  # this slot's segments (other tests' workers make their own in /dev/shm meanwhile)

    class RecordedId:
        def __init__(self) -> None:
            self.hex = uuid.uuid4().hex
            made.append(f"{staging_module.SEGMENT_PREFIX}{self.hex[:16]}")

    fake_uuid = type(uuid)("fake_uuid")
    fake_uuid.uuid4 = RecordedId
    monkeypatch.setattr(staging_module, "uuid", fake_uuid)
    for index in range(20):
        slot.handle(b"trainer", p.WeightsBegin(f"u{index}", SPEC, partial=True, transport="shm"), [], None)
        time.sleep(0.05)
        slot.handle(b"trainer", p.WeightsAbort(f"u{index}"), [], None)
    _serve(slot, 2 * SLOW_S)
    assert live["peak"] == 1, live
    slot.close()
    assert made and not [name for name in made if os.path.exists(f"/dev/shm/{name}")]


def test_a_dead_updates_late_area_leaves_the_live_torch_distributed_update_its_group(slot, monkeypatch):
    """Update A's area is slow; the same trainer begins B (A is replaced), whose trainer side makes its group
    later: A, finishing its area after B asked for B's group, does not ask for A's, and B's group is joined."""
    real_host, calls = slot._staging.host, []

    def first_is_slow(nbytes):
        calls.append(nbytes)
        if len(calls) == 1:
            time.sleep(2 * SLOW_S)
        return real_host(nbytes)

    monkeypatch.setattr(slot._staging, "host", first_is_slow)
    stores = [make_store("127.0.0.1", 0, 2, True, 30) for _ in range(2)]

    def begin(update_id: str, store, group: str) -> p.WeightsBegin:
        dist = {"host": "127.0.0.1", "port": store.port, "world_size": 2, "rank": 1, "backend": "gloo", "group": group}
        return p.WeightsBegin(update_id, SPEC, partial=True, transport="torch.distributed", dist=dist)

    slot.handle(b"trainer", begin("A", stores[0], "ga"), [], None)
    time.sleep(0.2)
    slot.handle(b"trainer", begin("B", stores[1], "gb"), [], None)
    groups = []
    trainer = threading.Thread(
        target=lambda: time.sleep(2.5 * SLOW_S) or groups.append(make_process_group(stores[1], "gb", 0, 2, "gloo", 30))
    )
    trainer.start()
    _serve(slot, 8 * SLOW_S, lambda: len(slot.sent) >= 2)
    trainer.join(30)
    assert isinstance(slot.sent[0], p.Error) and slot.sent[0].code == "update_preempted", slot.sent
    assert isinstance(slot.sent[1], p.WeightsReady) and slot.sent[1].update_id == "B", slot.sent
    assert groups  # the trainer's end of B's group: released with its last reference (gloo has no abort)
