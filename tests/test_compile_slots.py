"""The worker's compile slots (rollout/service/compile/constraint_compiles.py) on the tiny tokenizer, with real xgrammar
compiles: a grammar that takes ~20 s to compile here (a long run of optional items: xgrammar's compile grows with the
cube of its length) is refused by name at the budget while another client's spec is served at once; a cancelled
compile's process is killed and its slot serves the next client; a client's queue is bounded; the compile server and
its children are gone after close; a compile past its memory budget is refused by name."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest

pytest.importorskip("xgrammar")

from rollout import ContinuousBatchingConfig, SamplingParams  # noqa: E402
from rollout.config import FieldError  # noqa: E402
from rollout.engine.manager.continuous_batching import QueueFullError, init_continuous_batching  # noqa: E402
from rollout.presets import tiny_model, tiny_tokenizer  # noqa: E402
from rollout.service.compile.constraint_compiles import ConstraintCompiles  # noqa: E402
from rollout.service.compile.jobs import (  # noqa: E402
    CompileAbandoned,
    CompileBudget,
    CompilesClosed,
    CompilesUnavailable,
)

BUDGET_S = 2.0
SLOW = "root ::= " + " ".join("[a-z]? [0-9]?" for _ in range(200))  # ~20 s to compile on the tiny vocabulary
# ~8 MB to compile (40 objects of 30 properties each)
INNER = {"type": "object", "properties": {f"q{j}": {"type": "integer"} for j in range(30)}}
BIG = {"type": "object", "properties": {f"p{i}": INNER for i in range(40)}}


def slow(variant: int) -> SamplingParams:
    return SamplingParams(grammar=SLOW + " " * variant)  # a new spec each time (a refused one is remembered)


def small_schema(key: str) -> SamplingParams:
    return SamplingParams(json={"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]})


class Outcomes:
    """Each job's outcome and when it came (seconds since this object was made)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.done: dict[str, tuple[float, BaseException | None]] = {}
        self._changed = threading.Condition()

    def __call__(self, job, error) -> None:
        with self._changed:
            self.done[job.item] = (time.monotonic() - self.start, error)
            self._changed.notify_all()

    def wait(self, name: str, timeout: float = 30.0) -> tuple[float, BaseException | None]:
        with self._changed:
            assert self._changed.wait_for(lambda: name in self.done, timeout), f"{name} never ended"
            return self.done[name]


def ready(compiles: ConstraintCompiles) -> ConstraintCompiles:
    compiles.start()
    deadline = time.monotonic() + 120
    while compiles.link.pid is None or compiles.link._state != "ready":
        assert time.monotonic() < deadline, "the compile server did not start"
        time.sleep(0.05)
    return compiles


@pytest.fixture(scope="module")
def intake():
    config = ContinuousBatchingConfig(num_blocks=16, block_size=16)
    manager = init_continuous_batching(tiny_model(0), continuous_batching_config=config, tokenizer=tiny_tokenizer())
    return manager.engine.intake


@pytest.fixture(scope="module")
def compiles(intake):
    compiles = ready(ConstraintCompiles(intake, CompileBudget(max_seconds=BUDGET_S, max_per_client=3)))
    yield compiles
    compiles.close()


def test_a_slow_grammar_is_refused_by_name_at_the_budget_while_another_client_is_served(compiles, intake):
    outcomes = Outcomes()
    compiles.submit("attacker", slow(0), outcomes, "slow")
    time.sleep(0.2)  # compiling now
    compiles.submit("other", small_schema("victim"), outcomes, "schema")
    compiles.submit("other", SamplingParams(regex="[a-z]{1,3}"), outcomes, "regex")
    for name in ("schema", "regex"):
        seconds, error = outcomes.wait(name)
        assert error is None and seconds < 1.0, (name, seconds, error)
    seconds, error = outcomes.wait("slow")
    assert isinstance(error, FieldError) and error.field == "grammar"
    assert error.reason == f"did not compile within {BUDGET_S:g} s (this worker's --max-compile-s)"
    assert BUDGET_S <= seconds < BUDGET_S + 1.5
    again = Outcomes()
    compiles.submit("attacker", slow(0), again, "again")  # refused at once: remembered, not compiled again
    seconds, error = again.wait("again")
    assert isinstance(error, FieldError) and error.reason.startswith("did not compile within") and seconds < 0.2
    # The engine's own compile of what the slots compiled is a cache hit, and the same grammar as xgrammar's.
    assert intake.grammars.is_cached(intake.tokenizer, intake.vocab_size, "regex", "[a-z]{1,3}")


def test_a_cancelled_compile_frees_its_slot_and_its_process(compiles):
    outcomes = Outcomes()
    first = compiles.submit("a", slow(1), outcomes, "a")
    compiles.submit("b", slow(2), outcomes, "b")  # both slots busy now (each client holds at most one)
    waiting = compiles.submit("c", small_schema("c"), outcomes, "c")
    time.sleep(0.3)
    assert first.state == "checking" and waiting.state == "waiting"
    children = _children(compiles.link.pid)
    cancelled_at = time.monotonic() - outcomes.start
    compiles.cancel(first)
    seconds, error = outcomes.wait("a")
    assert isinstance(error, CompileAbandoned) and seconds - cancelled_at < 0.5
    seconds, error = outcomes.wait("c")
    assert error is None and seconds - cancelled_at < 1.0  # served in the freed slot, long before b's deadline
    assert "b" not in outcomes.done
    assert len(children - _children(compiles.link.pid)) >= 1  # the cancelled compile's process was killed
    seconds, error = outcomes.wait("b")
    assert isinstance(error, FieldError) and seconds >= BUDGET_S


def test_a_clients_waiting_compiles_are_bounded_and_abandoned_with_it(compiles):
    outcomes = Outcomes()
    jobs = [compiles.submit("greedy", slow(10 + i), outcomes, f"g{i}") for i in range(3)]
    with pytest.raises(QueueFullError, match="--max-compiles-per-client"):
        compiles.submit("greedy", slow(20), outcomes, "over")
    compiles.submit("modest", small_schema("m"), outcomes, "m")  # another client is not bounded by it
    assert outcomes.wait("m")[1] is None
    compiles.cancel_client("greedy")  # its client left: waiting and running compiles end at once
    for index in range(3):
        seconds, error = outcomes.wait(f"g{index}")
        assert isinstance(error, CompileAbandoned) and seconds < BUDGET_S, (index, seconds, error)
    assert all(job.state == "finished" for job in jobs)


def test_a_compile_past_its_memory_budget_is_refused_by_name(intake):
    compiles = ready(ConstraintCompiles(intake, CompileBudget(max_seconds=30, max_bytes=1 << 20)))
    try:
        outcomes = Outcomes()
        compiles.submit("x", SamplingParams(json=json.dumps(BIG)), outcomes, "big")
        _, error = outcomes.wait("big")
        assert isinstance(error, FieldError) and error.field == "json"
        assert error.reason == "needs more memory to compile than 1 MiB (this worker's --max-compile-bytes)"
        compiles.submit("x", small_schema("small"), outcomes, "small")  # its child exited: another one compiles
        assert outcomes.wait("small")[1] is None
    finally:
        compiles.close()


def test_a_grammar_the_compile_process_sends_back_masks_as_xgrammars_own(compiles, intake, monkeypatch):
    """A grammar that took a while to compile comes back as xgrammar's JSON: the engine's cache then holds it, and
    it allows, step by step along a random path, exactly the tokens xgrammar's own compile of the spec allows."""
    import xgrammar

    adopted = []
    adopt = intake.grammars.adopt
    monkeypatch.setattr(intake.grammars, "adopt", lambda *args: adopt(*args) or adopted.append(args[2]))
    spec = "root ::= " + " ".join("[a-z]? [0-9]?" for _ in range(25))  # ~0.2 s to compile: sent back
    outcomes = Outcomes()
    compiles.submit("sent", SamplingParams(grammar=spec), outcomes, "sent")
    assert outcomes.wait("sent")[1] is None and adopted == ["grammar"]
    ours = intake.grammars.compile(intake.tokenizer, intake.vocab_size, "grammar", spec)  # the cache's: adopted
    info = intake.grammars.tokenizer_info(intake.tokenizer, intake.vocab_size)
    theirs = xgrammar.GrammarCompiler(info).compile_grammar(spec)
    matchers = [xgrammar.GrammarMatcher(ours), xgrammar.GrammarMatcher(theirs)]
    masks = [xgrammar.allocate_token_bitmask(1, info.vocab_size) for _ in matchers]
    rng = random.Random(0)
    steps = 0
    while not matchers[0].is_terminated():
        for matcher, mask in zip(matchers, masks):
            matcher.fill_next_token_bitmask(mask)
        assert masks[0].equal(masks[1])
        allowed = [t for t in range(info.vocab_size) if masks[0][0, t // 32] >> (t % 32) & 1]
        token = rng.choice(allowed)
        assert all(matcher.accept_token(token) for matcher in matchers)
        steps += 1
    assert matchers[1].is_terminated() and steps > 1


def test_a_compile_server_that_dies_is_started_again(compiles):
    """Its children die with it, a compile in flight is answered (not hung), and the next one starts a new server."""
    outcomes = Outcomes()
    compiles.submit("x", slow(50), outcomes, "in flight")
    time.sleep(0.3)
    server = compiles.link.pid
    children = _children(server)
    os.kill(server, signal.SIGKILL)
    _, error = outcomes.wait("in flight", 10)
    assert isinstance(error, CompilesUnavailable), error
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in children):
        assert time.monotonic() < deadline, "the dead server's children outlived it"
        time.sleep(0.05)
    compiles.submit("x", small_schema("after"), outcomes, "after")
    assert outcomes.wait("after", 120)[1] is None and compiles.link.pid not in (None, server)


def test_close_ends_every_compile_process_and_thread(compiles):
    """(The module's last use of `compiles`.)"""
    outcomes = Outcomes()
    compiles.submit("x", slow(40), outcomes, "running")
    compiles.submit("x", slow(41), outcomes, "waiting")
    time.sleep(0.3)
    processes = {compiles.link.pid, *_children(compiles.link.pid)}
    assert len(processes) >= 2
    threads = [thread for thread in threading.enumerate() if thread.name.startswith("rollout-compile")]
    assert threads
    started = time.monotonic()
    compiles.close()
    assert time.monotonic() - started < 5
    for name in ("running", "waiting"):
        assert isinstance(outcomes.wait(name, 1)[1], CompilesClosed)
    assert not any(_alive(pid) for pid in processes)
    assert not any(thread.is_alive() for thread in threads)
    with pytest.raises(QueueFullError, match="stopping"):
        compiles.submit("x", small_schema("late"), outcomes, "late")


def _children(pid: int | None) -> set[int]:
    """The live child processes of `pid`."""
    if pid is None:
        return set()
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return {int(child) for child in children.read().split()}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_xgrammars_mask_agrees_with_a_refusal_and_an_admission(intake):
    """What the slots refuse as allowing no first token, xgrammar's own matcher masks entirely; what they admit, it
    does not."""
    import xgrammar

    info = intake.grammars.tokenizer_info(intake.tokenizer, intake.vocab_size)
    compiler = xgrammar.GrammarCompiler(info)
    for regex, refused in ((r"[^\s\S]", True), ("\u20ac", True), ("[a-z]+", False)):
        matcher = xgrammar.GrammarMatcher(compiler.compile_regex(regex))
        bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        allowed = int(sum(bin(word & 0xFFFFFFFF).count("1") for word in bitmask[0].tolist()))
        assert (allowed == 0) == refused
        sampling = intake.resolve_sampling(SamplingParams(regex=regex))
        if refused:
            with pytest.raises(FieldError, match="regex: allows no token at the first step"):
                intake.constraint(sampling)
        else:
            intake.constraint(sampling)
