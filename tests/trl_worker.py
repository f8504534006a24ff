"""The worker fixtures the TRL test modules share (import `worker` and `client` into a module to use them): one
rollout-worker per module on the tiny preset (tiny_model(0)), its torch on one thread (2 cores, 2 processes), and a
RolloutClient to it per test."""

from __future__ import annotations

import pytest

from service_helpers import Worker
from trainer_bridge import RolloutClient


@pytest.fixture(scope="module")
def worker():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        server = Worker()
    yield server
    server.close()


@pytest.fixture
def client(worker):  # noqa: F811 - the fixture above, by name
    with RolloutClient(worker.address, timeout=60) as rollout_client:
        yield rollout_client
