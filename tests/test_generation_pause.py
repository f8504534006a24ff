"""`manager.control`: vLLM's generation pause on an in-process manager (keep, wait, abort), checked against the
manager's own outputs and transformers' `generate`, and the orders of calls that must neither hang nor let work in."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import reference_copy, tiny_model
from rollout import ContinuousBatchingConfig, init_continuous_batching


@pytest.fixture
def manager():
    model = tiny_model()
    manager = init_continuous_batching(model, continuous_batching_config=ContinuousBatchingConfig(num_blocks=64))
    manager.start()
    yield manager
    manager.stop()


def final(manager, request_id: str, timeout: float = 30):
    """The request's final output (None when none came within `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        output = manager.get_result(request_id, timeout=0.2)
        if output is not None and output.is_finished:
            return output
    return None


def long_request(manager, tokens: int = 400) -> str:
    request_id = manager.add_request([1, 2, 3, 4], max_new_tokens=tokens, min_new_tokens=tokens)
    while not manager.stats()["running"]:
        time.sleep(0.01)
    return request_id


def test_keep_holds_samples_and_queues_new_ones_until_resumed_with_the_same_tokens(manager):
    reference = tiny_model()
    held = long_request(manager, 40)
    assert manager.control.pause_generation("keep").held == 1 and manager.control.is_paused
    queued = manager.add_request([5, 6, 7], max_new_tokens=6)
    assert final(manager, queued, timeout=0.5) is None and final(manager, held, timeout=0.5) is None
    assert manager.control.resume_generation() and not manager.control.is_paused
    for request_id, prompt, count in ((held, [1, 2, 3, 4], 40), (queued, [5, 6, 7], 6)):
        output = final(manager, request_id)
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=count, do_sample=False, min_new_tokens=count
        )
        assert output.generated_tokens == expected[0, len(prompt) :].tolist()


def test_a_wait_pause_lets_nothing_in_while_it_drains_even_across_a_weight_update(manager):
    running = long_request(manager, 300)
    pausing = threading.Thread(target=manager.control.pause_generation, args=("wait",))
    pausing.start()
    time.sleep(0.1)
    update = {name: tensor.clone() for name, tensor in reference_copy(manager.engine.model).state_dict().items()}
    manager.update_weights(update, mode="keep")  # an update's commit resumes admission: the drain must not
    late = manager.add_request([9, 9], max_new_tokens=4)
    assert final(manager, running).finish_reason == "length"
    pausing.join(30)
    assert not pausing.is_alive() and manager.control.is_paused
    assert final(manager, late, timeout=0.5) is None  # queued behind the pause, not run during the drain
    manager.control.resume_generation()
    assert final(manager, late).finish_reason == "length"


def test_abort_ends_running_and_queued_groups_and_a_second_abort_ends_what_queued_meanwhile(manager):
    running = long_request(manager)
    assert manager.control.pause_generation("abort").aborted == 1
    output = final(manager, running)
    assert output.finish_reason == "abort" and 0 < len(output.generated_tokens) < 400
    queued = manager.add_request([5, 6], max_new_tokens=4)
    manager.control.pause_generation("abort")
    assert final(manager, queued).finish_reason == "abort"
    manager.control.resume_generation()


def test_a_wait_update_while_paused_with_held_samples_is_refused_by_name(manager):
    long_request(manager)
    manager.control.pause_generation("keep")
    update = {name: tensor.clone() for name, tensor in reference_copy(manager.engine.model).state_dict().items()}
    with pytest.raises(ValueError, match="mode.*generation is paused"):
        manager.update_weights(update, mode="wait", timeout=10)
    assert manager.update_weights(update, mode="recompute").recomputed == 1
    manager.control.resume_generation()


def test_control_calls_from_a_result_handler_or_a_stopped_manager_are_refused(manager):
    raised = []

    def handler(output):
        try:
            manager.control.reset_prefix_cache()
        except RuntimeError as error:
            raised.append(str(error))

    request_id = manager.add_request([1, 2], max_new_tokens=2)
    manager.register_result_handler(request_id, handler)
    deadline = time.monotonic() + 10
    while not raised and time.monotonic() < deadline:
        time.sleep(0.01)
    assert raised and "result handler" in raised[0]
    manager.stop()
    for call in (manager.control.resume_generation, manager.control.reset_prefix_cache):
        with pytest.raises(RuntimeError, match="stopped"):
            call()


def test_stop_while_a_wait_pause_drains_answers_its_caller(manager):
    long_request(manager, 1000)
    errors = []

    def pause():
        try:
            manager.control.pause_generation("wait")
        except RuntimeError as error:
            errors.append(error)

    pausing = threading.Thread(target=pause)
    pausing.start()
    time.sleep(0.2)
    manager.stop(timeout=30)
    pausing.join(10)
    assert not pausing.is_alive() and errors and "stopped" in str(errors[0])
