"""HTTP callers take admission turns by address, as ZeroMQ clients do by connection or key: one caller's flood of
requests queues behind its own turns, so another caller's request is admitted with the next free room, not after
the whole flood (every HTTP caller was one client, in arrival order)."""

from __future__ import annotations

import threading
import time

import httpx2 as httpx  # the HTTP library the openai client is built on

from rollout.config import ContinuousBatchingConfig
from rollout.engine.manager.continuous_batching import init_continuous_batching
from rollout.presets import tiny_model, tiny_tokenizer
from rollout.service.http.serving.server import HttpServer
from rollout.service.http.serving.settings import HttpSettings


def test_a_callers_request_is_not_queued_behind_another_callers_flood():
    config = ContinuousBatchingConfig(num_blocks=64, block_size=16, max_num_seqs=1)  # one sample at a time
    manager = init_continuous_batching(tiny_model(), continuous_batching_config=config, tokenizer=tiny_tokenizer())
    manager.start()
    http = HttpServer(manager, tiny_tokenizer(), HttpSettings(max_n=8)).start()
    finished: list[str] = []
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 96, "ignore_eos": True, "temperature": 0}

    def send(name: str, address: str) -> None:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=120) as client:
            assert client.post(f"{http.url}/v1/completions", json=body).status_code == 200
        finished.append(name)

    try:
        flood = [threading.Thread(target=send, args=(f"a{i}", "127.0.0.1")) for i in range(4)]
        for thread in flood:
            thread.start()
        deadline = time.monotonic() + 60
        scheduler = manager.engine.scheduler
        while len(scheduler.waiting) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)  # the flood is in: one running, three waiting
        other = threading.Thread(target=send, args=("b", "127.0.0.2"))
        other.start()
        for thread in [*flood, other]:
            thread.join(120)
    finally:
        http.stop()
        manager.stop()
    # b took the turn after the running request's: it finished before the flood's last two (before: last).
    assert len(finished) == 5 and finished.index("b") <= 2, finished
