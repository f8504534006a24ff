"""A fleet's membership decisions on versions polled late (a worker frozen, then resumed, answers a poll with the
version it served then): the catch-up and the choice of a peer to copy from ask the workers for their version first.
Fake actors stand in for Ray's (no cluster: `ray.get` returns what a fake call computes)."""

from __future__ import annotations

import logging
import time

import pytest

membership = pytest.importorskip("rollout.ray.membership")


class _Call:
    """A fake actor method: `.remote(...)` returns a reference that the patched `ray.get` evaluates."""

    def __init__(self, function):
        self.function = function

    def remote(self, *args):
        return (self.function, args)


class FakeActor:
    """A worker whose served version is `version` now (its slot's info may hold an older poll's)."""

    def __init__(self, address: str, version: int):
        self.address, self.version, self.copied_to = address, version, []
        self.info = _Call(
            lambda: {"address": address, "version": self.version, "http": None, "pid": 1, "started_at": 0.0}
        )
        self.copy_weights_to = _Call(self._copy)

    def _copy(self, address: str, timeout: float) -> int:
        self.copied_to.append(address)
        return self.version


@pytest.fixture
def fleet(monkeypatch):
    monkeypatch.setattr(membership.ray, "get", lambda reference, timeout=None: reference[0](*reference[1]))
    return membership.Membership(copy_timeout=5.0)


def slot_of(actor: FakeActor, polled_version: int, joined: bool = True) -> membership.Slot:
    info = {"address": actor.address, "version": polled_version, "http": None, "pid": 1, "started_at": 0.0}
    return membership.Slot(actor, None, 0, info=info, joined=actor.address if joined else None)


def test_a_worker_whose_poll_was_late_is_not_copied_to_when_it_serves_the_newest(fleet, caplog):
    """Its last poll said version 1; it serves 2 now: the catch-up asks it first, copies nothing, logs nothing."""
    resumed, peer = FakeActor("tcp://resumed", 2), FakeActor("tcp://peer", 2)
    fleet.slots = [slot_of(resumed, 1), slot_of(peer, 2)]
    fleet.newest_version = 2
    fleet.slots[0].behind_since = time.monotonic() - membership.CATCH_UP_S - 1
    with caplog.at_level(logging.INFO, logger="rollout.ray"):
        fleet._catch_up()
    assert peer.copied_to == [] and fleet.slots[0].joined == "tcp://resumed"
    assert fleet.slots[0].info["version"] == 2
    assert "behind" not in caplog.text


def test_a_joining_worker_copies_from_a_peer_whose_poll_was_late(fleet, caplog):
    """The peer's last poll said version 1, it serves 2 now: the joining worker copies 2 from it (it was told no
    live worker held version 2)."""
    joining, peer = FakeActor("tcp://joining", 0), FakeActor("tcp://peer", 2)
    fleet.slots = [slot_of(joining, 0, joined=False), slot_of(peer, 1)]
    fleet.newest_version = 2
    with caplog.at_level(logging.INFO, logger="rollout.ray"):
        fleet.join(fleet.slots[0])
    assert peer.copied_to == ["tcp://joining"]
    assert fleet.slots[0].info["version"] == 2 and fleet.slots[0].joined == "tcp://joining"
    assert "no live worker holds" not in caplog.text
