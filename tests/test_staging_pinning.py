"""A GPU worker's shared-memory staging segment is page-locked for its copies (`cudaHostRegister`) and unlocked before
it is unmapped, exactly once, whatever path frees it; a segment that cannot be locked still serves, with a warning.
CUDA's runtime is replaced by a recorder here (no GPU on this machine); tests/gpu/test_gpu.py checks the real one."""

from __future__ import annotations

import logging

import pytest
import torch

from rollout.protocol import staging


class _Runtime:
    """Records cudaHostRegister / cudaHostUnregister calls; the address of a live registration must be mapped."""

    def __init__(self, register_code: int = 0):
        self.register_code = register_code
        self.registered: dict[int, int] = {}  # address -> bytes
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", address))
        if self.register_code == 0:
            assert address not in self.registered, "registered twice"
            self.registered[address] = size
        return self.register_code

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        self.calls.append(("unregister", address))
        assert address in self.registered, "unregistered what was never registered"
        del self.registered[address]
        return 0


@pytest.fixture
def runtime(monkeypatch):
    fake = _Runtime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_a_pinned_pools_segment_is_registered_once_and_unregistered_before_it_goes(runtime, monkeypatch):
    released = []
    real_release = staging.release_segment

    def release(segment, view):  # the segment must still be registered-then-unregistered while mapped
        released.append(view.data_ptr())
        real_release(segment, view)
        assert view.data_ptr() not in runtime.registered

    monkeypatch.setattr(staging, "release_segment", release)
    pool = staging.StagingPool(keep=True, pin=True)
    segment, view = pool.shared(1 << 16)
    first = view.data_ptr()
    assert runtime.registered == {first: 1 << 16}
    view[:4].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))  # still an ordinary host buffer
    pool.give_back(None, (segment, view))
    kept = pool.shared(100)  # the kept segment: registered once, not again
    assert kept[1].data_ptr() == first and runtime.calls == [("register", first)]
    pool.give_back(None, kept)
    grown = pool.shared(1 << 17)  # too small: the old one unregistered and freed, the new one registered
    assert runtime.registered == {grown[1].data_ptr(): 1 << 17}
    assert ("unregister", first) in runtime.calls and released == [first]
    pool.give_back(None, grown)
    del segment, view, kept
    pool.close()
    assert runtime.registered == {}
    assert [name for name, _ in runtime.calls] == ["register", "unregister", "register", "unregister"]


def test_an_unpinned_pool_and_a_cpu_host_register_nothing(runtime, monkeypatch):
    pool = staging.StagingPool(keep=False, pin=False)
    pool.give_back(None, pool.shared(4096))
    assert runtime.calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pinned = staging.StagingPool(keep=False, pin=True)
    pinned.give_back(None, pinned.shared(4096))
    assert runtime.calls == []


def test_a_segment_that_cannot_be_locked_still_serves_and_says_why(runtime, caplog):
    runtime.register_code = 2  # cudaErrorMemoryAllocation
    pool = staging.StagingPool(keep=False, pin=True)
    with caplog.at_level(logging.WARNING, logger="rollout.protocol.staging"):
        segment, view = pool.shared(4096)
    assert "could not page-lock a 4096-byte staging segment (cudaError 2)" in caplog.text
    view.fill_(7)
    assert int(view.sum()) == 7 * 4096
    pool.give_back(None, (segment, view))  # freed (not keeping): nothing to unregister
    assert [name for name, _ in runtime.calls] == ["register"]
