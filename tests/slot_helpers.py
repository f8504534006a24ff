"""A worker's weight-update slot in process, without sockets (`open_slot`): its replies are collected in `.sent`;
`replies` concludes finished steps as the serving loop does."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from conftest import tiny_model
from rollout import protocol as p
from rollout.config import ContinuousBatchingConfig
from rollout.engine.manager.continuous_batching import init_continuous_batching
from rollout.service.weights.update_slot import UpdateSlot

SLOW_S = 1.0  # what a patched step costs: far above what the serving thread may spend per message


@contextlib.contextmanager
def open_slot(model: Any = None) -> Iterator[UpdateSlot]:
    """An update slot over a tiny model's engine (or `model`'s); replies go to its `sent` list. Closed on exit."""
    manager = init_continuous_batching(
        model or tiny_model(), continuous_batching_config=ContinuousBatchingConfig(num_blocks=32, block_size=16)
    )
    sent: list[p.Message] = []
    woken = threading.Event()
    keys: list[str | None] = []  # the key each reply was sent for (None: none)

    def send(identity: bytes, message: p.Message, key: str | None = None) -> None:
        sent.append(message)
        keys.append(key)

    update_slot = UpdateSlot(manager, send, woken.set, 600.0)
    update_slot.sent, update_slot.sent_keys = sent, keys
    try:
        yield update_slot
    finally:
        update_slot.close()


def replies(slot: UpdateSlot, count: int, timeout_s: float = 20.0) -> list[p.Message]:
    """Conclude finished steps (as the serving loop does) until `count` replies were sent."""
    deadline = time.monotonic() + timeout_s
    while len(slot.sent) < count:
        assert time.monotonic() < deadline, f"only {slot.sent}"
        slot.conclude()
        time.sleep(0.01)
    return slot.sent


def timed(call: Callable[[], object]) -> float:
    """Seconds `call()` took."""
    started = time.monotonic()
    call()
    return time.monotonic() - started
