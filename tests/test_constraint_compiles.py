"""A worker compiles structured-output constraints off its serving loop: a spec that takes seconds to compile (as
`[a-z]{1,2000}` does against a 128k vocabulary) stalls no other client; its group is answered once compiled, can be
cancelled meanwhile, and is answered "busy" when the worker stops first. The compile is made slow on purpose (the
tiny vocabulary compiles anything in milliseconds)."""

from __future__ import annotations

import re
import threading
import time

import pytest

pytest.importorskip("xgrammar")

from rollout import ContinuousBatchingConfig  # noqa: E402
from rollout.engine.manager import init_continuous_batching  # noqa: E402
from rollout.service import protocol as p  # noqa: E402
from rollout.service.presets import tiny_model, tiny_tokenizer  # noqa: E402
from rollout.service.worker import RolloutWorker  # noqa: E402
from service_helpers import Client  # noqa: E402

TOKENIZER = tiny_tokenizer()
SLOW_S = 0.5
SLOW = r"slow[a-z]{3}"  # the spec whose compile sleeps


@pytest.fixture(scope="module")
def worker():
    config = ContinuousBatchingConfig(num_blocks=64, block_size=16)
    manager = init_continuous_batching(tiny_model(0), continuous_batching_config=config, tokenizer=TOKENIZER)
    compile_constraint = manager.engine.intake.constraint

    def slow_compile(sampling):
        if sampling.regex == SLOW:
            time.sleep(SLOW_S)
        return compile_constraint(sampling)

    manager.engine.intake.constraint = slow_compile
    server = RolloutWorker(manager, "tcp://127.0.0.1:*", "tiny")
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    server.thread = thread
    yield server
    server.shutdown()
    thread.join(30)


def generate(group_id: str, **sampling) -> p.Generate:
    return p.Generate(group_id, TOKENIZER("go")["input_ids"], n=2, sampling={"max_new_tokens": 16, **sampling})


def test_a_slow_compile_stalls_no_other_client(worker):
    slow, other = Client(worker.address), Client(worker.address)
    start = time.monotonic()
    slow.send(generate("slow", regex=SLOW, seed=1))
    assert isinstance(other.ask(p.Ping(7)), p.Pong)
    plain = other.ask(generate("plain", seed=2))
    served = time.monotonic()
    assert isinstance(plain, p.GroupResult)
    result = slow.receive()
    assert isinstance(result, p.GroupResult) and time.monotonic() - start >= SLOW_S
    assert not slow.socket.poll(0) and served - start < SLOW_S  # the other client was served while it compiled
    texts = [TOKENIZER.decode(c.token_ids, skip_special_tokens=True) for c in result.completions]
    assert all(re.fullmatch(SLOW, text) for text in texts), texts
    refused = slow.ask(generate("bad", regex="(unclosed"))
    assert isinstance(refused, p.Error) and refused.field == "sampling.regex" and refused.group_id == "bad"
    deep = slow.ask(generate("deep", json="[" * 3000 + "]" * 3000))  # deeper than Python's recursion limit
    assert isinstance(deep, p.Error) and deep.field == "sampling.json" and deep.code == "bad_request"
    assert isinstance(slow.ask(generate("deep", seed=3)), p.GroupResult)  # the refused group's id is free again


def test_a_group_cancelled_while_compiling_ends_with_abort_and_a_stopping_worker_answers_busy(worker):
    client = Client(worker.address)
    client.send(generate("cancelled", regex=SLOW))
    client.send(p.Cancel("cancelled"))
    result = client.receive()
    assert isinstance(result, p.GroupResult) and result.group_id == "cancelled"
    assert [c.finish_reason for c in result.completions] == ["abort", "abort"]
    client.send(generate("orphan", regex=SLOW))
    time.sleep(0.2)  # compiling now
    worker.shutdown()
    reply = client.receive()
    assert isinstance(reply, p.Error) and reply.code == "busy" and reply.group_id == "orphan"
    worker.thread.join(30)
    assert not worker.thread.is_alive()
