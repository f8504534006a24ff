"""A GPU worker's shared-memory staging segment is page-locked for its copies (`cudaHostRegister`, with the worker's
own GPU current) and unlocked before it is unmapped, exactly once, whatever path frees it; a segment that cannot be
locked still serves, with a warning.
CUDA's runtime is replaced by a recorder here (no GPU on this machine); tests/gpu/test_gpu.py checks the real one."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from rollout.protocol import staging

GPU = torch.device("cuda", 3)  # a worker's GPU that is not the threads' current device (0)


class _Runtime:
    """Records cudaHostRegister / cudaHostUnregister calls and the device current at each (`torch.cuda.device`)."""

    def __init__(self, register_code: int = 0):
        self.register_code = register_code
        self.registered: dict[int, int] = {}  # address -> bytes
        self.calls: list[tuple[str, int]] = []
        self.current: torch.device | None = None  # set by `torch.cuda.device` below

    def device(self, device: torch.device) -> contextlib.AbstractContextManager:
        @contextlib.contextmanager
        def current():
            self.current = device
            try:
                yield
            finally:
                self.current = None

        return current()

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        assert self.current == GPU, "registered with another device current"
        self.calls.append(("register", address))
        if self.register_code == 0:
            assert address not in self.registered, "registered twice"
            self.registered[address] = size
        return self.register_code

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        assert self.current == GPU, "unregistered with another device current"
        self.calls.append(("unregister", address))
        assert address in self.registered, "unregistered what was never registered"
        del self.registered[address]
        return 0


@pytest.fixture
def runtime(monkeypatch):
    fake = _Runtime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    return fake


def test_a_pinned_pools_segment_is_registered_once_and_unregistered_before_it_goes(runtime, monkeypatch):
    released = []
    real_release = staging.release_segment

    def release(segment, view):  # the segment must still be registered-then-unregistered while mapped
        released.append(view.data_ptr())
        real_release(segment, view)
        assert view.data_ptr() not in runtime.registered

    monkeypatch.setattr(staging, "release_segment", release)
    pool = staging.StagingPool(keep=True, pin_device=GPU)
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
    pool = staging.StagingPool(keep=False)
    pool.give_back(None, pool.shared(4096))
    assert runtime.calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pinned = staging.StagingPool(keep=False, pin_device=GPU)
    pinned.give_back(None, pinned.shared(4096))
    assert runtime.calls == []


def test_a_segment_that_cannot_be_locked_still_serves_and_says_why(runtime, caplog):
    runtime.register_code = 2  # cudaErrorMemoryAllocation
    pool = staging.StagingPool(keep=False, pin_device=GPU)
    with caplog.at_level(logging.WARNING, logger="rollout.protocol.staging"):
        segment, view = pool.shared(4096)
    assert "could not page-lock a 4096-byte staging segment (cudaError 2)" in caplog.text
    view.fill_(7)
    assert int(view.sum()) == 7 * 4096
    pool.give_back(None, (segment, view))  # freed (not keeping): nothing to unregister
    assert [name for name, _ in runtime.calls] == ["register"]


def test_a_cuda_runtime_that_raises_leaves_the_segment_serving_unlocked(runtime, monkeypatch, caplog):
    def unreachable():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "cudart", unreachable)
    pool = staging.StagingPool(keep=False, pin_device=GPU)
    with caplog.at_level(logging.WARNING, logger="rollout.protocol.staging"):
        segment, view = pool.shared(4096)
    assert "CUDA driver initialization failed" in caplog.text
    view.fill_(1)
    pool.give_back(None, (segment, view))  # freed, nothing to unregister


def test_the_shm_sender_stages_only_into_the_segments_of_workers_still_pushed_to_over_shm():
    """A bucket goes into the segment of each worker still in the push over shm, not into the segment of a worker
    lost meanwhile or gone over to frames; the bytes it returns for the checksum are the bucket's."""
    from types import SimpleNamespace

    from rollout.protocol.transports.shm import ShmSender
    from rollout.protocol.weight_messages import TensorSpec, WeightsReady

    specs = [TensorSpec("a", "uint8", [100])]
    offsets, total = staging.staging_layout(specs)
    pool = staging.StagingPool(keep=False)
    areas = [pool.shared(total) for _ in range(3)]
    links = [SimpleNamespace(index=index, transport="shm") for index in range(3)]
    push = SimpleNamespace(links=[links[0], links[2]])  # worker 1 was lost
    sender = ShmSender(push)
    for link, (segment, _) in zip(links, areas):
        sender.attach(link, WeightsReady("u", total, segment.name), specs)
    links[2].transport = "frames"  # its worker could not go on over shm
    data = torch.arange(100, dtype=torch.uint8)
    hashed = sender.stage([(0, 0, data[:60]), (0, 60, data[60:])], offsets)
    assert torch.equal(torch.cat(hashed), data)
    assert torch.equal(areas[0][1][:100], data)
    assert not areas[1][1].any() and not areas[2][1].any()
    del hashed
    sender.close()
    for area in areas:
        pool.give_back(None, area)
