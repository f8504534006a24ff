"""A result handler registered from plain code runs on the engine thread (rollout's extension: transformers runs
handlers on an event loop only). A call that waits for the engine thread from there waits on itself: the engine
never steps again, `stop()` cannot end it, and every request in flight is lost. Such calls must refuse at once,
naming why, and the engine must go on serving."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from conftest import tiny_model
from rollout import ContinuousBatchingConfig, SamplingParams, init_continuous_batching

pytestmark = pytest.mark.timeout(90)
TIMEOUT = 20.0
GREEDY = SamplingParams(do_sample=False, stop_token_ids=())
MODEL = tiny_model()

WAITING_CALLS: dict[str, Callable[[Any], Any]] = {
    "get_result": lambda manager: manager.get_result("other", timeout=None),
    "request_id_iter": lambda manager: next(iter(manager.request_id_iter("other"))),
    "iteration": lambda manager: next(iter(manager)),
    "join": lambda manager: manager.join(timeout=None),
    "update_weights": lambda manager: manager.update_weights(
        {name: tensor.clone() for name, tensor in MODEL.state_dict().items()}, timeout=None
    ),
}


@pytest.mark.parametrize("call", list(WAITING_CALLS), ids=list(WAITING_CALLS))
def test_a_call_that_waits_for_the_engine_refuses_inside_a_result_handler(call):
    """The handler's call raises a RuntimeError naming the engine thread, and the other request still completes
    with the tokens it gets when no handler interferes."""
    config = ContinuousBatchingConfig(num_blocks=64, block_size=4)
    outcome: dict[str, Any] = {}
    answered = threading.Event()

    def handler(output: Any) -> None:
        if output.is_finished:
            try:
                outcome["value"] = WAITING_CALLS[call](manager)
            except Exception as error:  # noqa: BLE001 - the test reads it
                outcome["error"] = error
            answered.set()

    manager = init_continuous_batching(MODEL, None, config).start()
    try:
        alone = manager.get_result(manager.add_request([1, 2, 3, 4], max_new_tokens=20, sampling=GREEDY), TIMEOUT)
        manager.register_result_handler("short", handler)
        manager.add_request([1, 2, 3, 4], "other", 20, sampling=GREEDY)
        manager.add_request([1, 2, 3], "short", 2, sampling=GREEDY)
        assert answered.wait(TIMEOUT), f"{call} from a result handler waited on the engine thread itself"
        other = manager.get_result("other", timeout=TIMEOUT)
    finally:
        manager.stop(timeout=TIMEOUT)  # bounded: a stuck engine thread must fail the test, not hang it
    assert isinstance(outcome.get("error"), RuntimeError) and "engine thread" in str(outcome["error"])
    assert other is not None and other.generated_tokens == alone.generated_tokens


def test_get_result_without_waiting_still_works_inside_a_result_handler():
    """`get_result(timeout=0)` waits for nothing: a handler may take an output already queued."""
    config = ContinuousBatchingConfig(num_blocks=64, block_size=4)
    taken: list[Any] = []
    answered = threading.Event()

    def handler(output: Any) -> None:
        if output.is_finished:
            taken.append(manager.get_result("first", timeout=0))
            answered.set()

    with init_continuous_batching(MODEL, None, config) as manager:
        manager.register_result_handler("second", handler)
        with manager.pause():  # both start in one step, so "first" (2 tokens) is queued when "second" (6) ends
            manager.add_request([1, 2, 3], "first", 2, sampling=GREEDY)
            manager.add_request([1, 2, 3], "second", 6, sampling=GREEDY)
        assert answered.wait(TIMEOUT)
    assert taken[0] is not None and taken[0].request_id == "first" and len(taken[0].generated_tokens) == 2
