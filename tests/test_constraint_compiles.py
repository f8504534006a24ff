"""A worker compiles structured-output constraints off its serving loop, in turn between clients and within its
compile budget (--max-compile-s): a grammar that takes ~20 s to compile on the tiny vocabulary (a long run of
optional items) is refused by name at the budget while another client's group is served; a group cancelled, or whose
client leaves, while its constraint compiles ends at once and frees its compile slot; a stopping worker answers
"busy" and leaves no compile process behind; a worker starts its compile processes with the first new spec."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

pytest.importorskip("xgrammar")

from test_compile_slots import SLOW, _alive, _children  # noqa: E402

from rollout import ContinuousBatchingConfig  # noqa: E402
from rollout import protocol as p  # noqa: E402
from rollout.engine.manager.continuous_batching import init_continuous_batching  # noqa: E402
from rollout.presets import tiny_model, tiny_tokenizer  # noqa: E402
from rollout.service.zmq.limits import WorkerLimits  # noqa: E402
from rollout.service.zmq.worker import RolloutWorker  # noqa: E402
from service_helpers import Client, Worker  # noqa: E402

TOKENIZER = tiny_tokenizer()
BUDGET_S = 2.0
REGEX = r"ok[a-z]{3}"


@pytest.fixture(scope="module")
def worker():
    config = ContinuousBatchingConfig(num_blocks=64, block_size=16)
    manager = init_continuous_batching(tiny_model(0), continuous_batching_config=config, tokenizer=TOKENIZER)
    server = RolloutWorker(manager, "tcp://127.0.0.1:*", "tiny", limits=WorkerLimits(max_compile_s=BUDGET_S))
    server.compiles.start()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    server.thread = thread
    deadline = time.monotonic() + 120
    while server.compiles.link._state != "ready":  # timings below count from a running compile server
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield server
    server.shutdown()
    thread.join(30)


def generate(group_id: str, **sampling) -> p.Generate:
    return p.Generate(group_id, TOKENIZER("go")["input_ids"], n=2, sampling={"max_new_tokens": 16, **sampling})


def accepted(worker: RolloutWorker, field: str, spec: dict, tokens: list[int]) -> bool:
    """Whether xgrammar's own matcher for the spec accepts every token (the samples may stop at max_new_tokens)."""
    import xgrammar

    intake = worker.manager.engine.intake
    info = intake.grammars.tokenizer_info(intake.tokenizer, intake.vocab_size)
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(spec)))
    return all(matcher.accept_token(token) for token in tokens)


def schema(key: str) -> dict:
    return {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]}


def test_a_slow_grammar_is_refused_by_name_while_another_client_is_served(worker):
    slow, other = Client(worker.address), Client(worker.address)
    start = time.monotonic()
    slow.send(generate("slow", grammar=SLOW, seed=1))
    assert isinstance(other.ask(p.Ping(7)), p.Pong)
    served = other.ask(generate("schema", json=schema("first"), seed=2))
    assert isinstance(served, p.GroupResult) and time.monotonic() - start < 1.5
    assert all(accepted(worker, "json", schema("first"), c.token_ids) for c in served.completions)
    refused = slow.receive()
    assert isinstance(refused, p.Error) and refused.code == "bad_request" and refused.group_id == "slow"
    assert refused.field == "sampling.grammar"
    assert refused.message == f"sampling.grammar: did not compile within {BUDGET_S:g} s (this worker's --max-compile-s)"
    assert BUDGET_S <= time.monotonic() - start < BUDGET_S + 2
    bad = slow.ask(generate("bad", regex="(unclosed"))
    assert isinstance(bad, p.Error) and bad.field == "sampling.regex" and bad.group_id == "bad"
    deep = slow.ask(generate("deep", json="[" * 3000 + "]" * 3000))  # deeper than Python's recursion limit
    assert isinstance(deep, p.Error) and deep.field == "sampling.json" and deep.code == "bad_request"
    nothing = slow.ask(generate("nothing", regex=r"[^\s\S]"))  # compiles, but no token can start it
    assert isinstance(nothing, p.Error) and nothing.field == "sampling.regex" and "no token" in nothing.message
    short = slow.ask(generate("short", choice=["a"], min_new_tokens=3, stop_token_ids=[TOKENIZER.eos_token_id]))
    assert isinstance(short, p.Error) and short.field == "sampling.choice" and "min_tokens=3" in short.message
    assert isinstance(slow.ask(generate("deep", regex=REGEX, seed=3)), p.GroupResult)  # the refused id is free


def test_a_group_cancelled_or_left_while_compiling_ends_at_once_and_frees_its_slot(worker):
    holder, leaving, waiting, canceller = (Client(worker.address) for _ in range(4))
    holder.send(generate("held", grammar=SLOW + " "))  # holds one slot until the budget
    held_until = time.monotonic() + BUDGET_S
    leaving.send(generate("left", grammar=SLOW + "  "))  # holds the other
    time.sleep(0.3)
    waiting.send(generate("waits", json=schema("second"), seed=4))
    time.sleep(0.2)
    assert not waiting.socket.poll(0)  # no slot free
    left_at = time.monotonic()
    leaving.socket.close()  # its client leaves: its compile is killed, its slot serves the waiting group
    assert isinstance(waiting.receive(), p.GroupResult) and time.monotonic() - left_at < 1.2
    canceller.send(generate("cancelled", grammar=SLOW + "   "))  # takes the freed slot
    time.sleep(0.3)
    cancelled_at = time.monotonic()
    canceller.send(p.Cancel("cancelled"))
    result = canceller.receive()
    assert isinstance(result, p.GroupResult) and result.group_id == "cancelled"
    assert [c.finish_reason for c in result.completions] == ["abort", "abort"] and time.monotonic() - cancelled_at < 1
    fresh = Client(worker.address)
    assert isinstance(fresh.ask(generate("fresh", json=schema("third"))), p.GroupResult)
    assert time.monotonic() - cancelled_at < 1.5
    if time.monotonic() < held_until - 0.2:  # (a loaded machine may reach the held one's budget before this line)
        assert not holder.socket.poll(0)  # served while "held" compiles
        assert worker.compiles.num_active == 1  # the held one: nothing left of the cancelled or abandoned ones
    refused = holder.receive()
    assert isinstance(refused, p.Error) and refused.field == "sampling.grammar"  # past the budget
    assert worker.compiles.num_active == 0


def test_a_stopping_worker_answers_busy_and_leaves_no_compile_process(worker):
    client = Client(worker.address)
    client.send(generate("orphan", grammar=SLOW + "    "))
    time.sleep(0.3)  # compiling now
    processes = {worker.compiles.link.pid, *_children(worker.compiles.link.pid)}
    worker.shutdown()
    reply = client.receive()
    assert isinstance(reply, p.Error) and reply.code == "busy" and reply.group_id == "orphan"
    worker.thread.join(30)
    assert not worker.thread.is_alive()
    assert not any(_alive(pid) for pid in processes)


def test_the_compile_processes_start_with_the_first_new_spec_and_die_with_a_killed_worker():
    """rollout-worker starts no compile process until a spec it has not cached arrives (--preload-compiles starts
    them with it); SIGKILL the worker (no cleanup runs) and the server and its children go with it
    (PR_SET_PDEATHSIG, parent to child to grandchild)."""
    server = Worker()
    client = Client(server.address)
    try:
        time.sleep(1.0)  # answering pings: a compile server started with the worker would be forking by now
        assert descendants(server.process.pid) == set()
        served = client.ask(generate("first", regex=REGEX, seed=5))
        assert isinstance(served, p.GroupResult), served
        assert all(TOKENIZER.decode(c.token_ids).startswith("ok") for c in served.completions)
        deadline = time.monotonic() + 120
        while len(descendants(server.process.pid)) < 2:  # the compile server and its idle children
            assert time.monotonic() < deadline, "no compile server started"
            time.sleep(0.1)
        processes = descendants(server.process.pid)
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(10)
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in processes):
            assert time.monotonic() < deadline, "compile processes outlived their worker"
            time.sleep(0.05)
    finally:
        client.close()
        server.close()


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (the children of each of its threads, theirs, ...)."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as children:
                    new = {int(child) for child in children.read().split()} - found
            except FileNotFoundError:
                continue
            found |= new
            todo.extend(new)
    return {child for child in found if _alive(child)}
