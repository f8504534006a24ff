"""The manager and output contract as transformers' continuous batching documents it: `GenerationOutput` built and
read as transformers builds and reads its own (status, is_finished(), timestamps), handlers on the caller's event
loop, add_requests, iteration, pause, destroy, and generate_batch's record_timestamps / persistent_manager /
warmup."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import threading
import time

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.requests import GenerationOutput as TransformersOutput
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

from conftest import make_prompts, reference_copy, tiny_model
from rollout import ContinuousBatchingConfig, GenerationOutput, SamplingParams, generate_batch, init_continuous_batching
from rollout.engine.generate import cached_engine, release_cached_engine

CACHE = ContinuousBatchingConfig(num_blocks=128, block_size=4)
GREEDY = SamplingParams(do_sample=False, stop_token_ids=())


def test_generation_output_has_every_field_of_transformers_and_is_built_like_it():
    """Every field of transformers' GenerationOutput exists here; one built from transformers' own RequestState
    fields reads the same (status compares equal to transformers' RequestStatus, is_finished() is callable)."""
    ours = {f.name for f in dataclasses.fields(GenerationOutput)}
    assert {f.name for f in dataclasses.fields(TransformersOutput)} <= ours
    state = RequestState(request_id="r", initial_tokens=[1, 2, 3])
    state.generated_tokens = [4, 5]
    state.status = RequestStatus.FINISHED
    theirs = state.to_generation_output()
    built = GenerationOutput(**{f.name: getattr(theirs, f.name) for f in dataclasses.fields(TransformersOutput)})
    assert built.is_finished() is True and built.is_finished and built.status == RequestStatus.FINISHED
    assert (built.prompt_ids, built.generated_tokens, built.group_id) == ([1, 2, 3], [4, 5], "r")
    running = GenerationOutput("r", [1], [2], status=RequestStatus.DECODING)
    assert running.is_finished() is False and not running.is_finished
    failed = GenerationOutput("r", error="boom", status=RequestStatus.FAILED)
    assert failed.is_finished() and failed.status == RequestStatus.FAILED


def test_outputs_carry_status_times_and_timestamps():
    model = tiny_model("qwen3")
    prompts = make_prompts(3, 4, 10, seed=1)
    before = time.perf_counter()
    outputs = generate_batch(
        model,
        prompts,
        sampling=GREEDY,
        max_new_tokens=5,
        continuous_batching_config=CACHE,
        progress_bar=False,
        record_timestamps=True,
    )
    for output in outputs.values():
        assert output.status == RequestStatus.FINISHED and output.is_finished()
        start, end = output.lifespan
        assert before <= output.created_time <= start <= output.timestamps[0]
        assert output.timestamps == sorted(output.timestamps) and len(output.timestamps) == 5
        assert output.timestamps[-1] <= end <= time.perf_counter()
    plain = generate_batch(model, prompts[:1], sampling=GREEDY, max_new_tokens=2, progress_bar=False)
    assert plain["req_0"].timestamps is None


def test_streamed_deltas_carry_their_own_timestamps_and_status():
    model = tiny_model("qwen3")
    with init_continuous_batching(model, continuous_batching_config=CACHE) as manager:
        request_id = manager.add_request(
            [1, 2, 3], max_new_tokens=4, streaming=True, sampling=GREEDY, record_timestamps=True
        )
        deltas = list(manager.request_id_iter(request_id, timeout=30))
    assert [d.status for d in deltas] == [RequestStatus.DECODING] * (len(deltas) - 1) + [RequestStatus.FINISHED]
    assert all(len(d.timestamps) == len(d.generated_tokens) for d in deltas)
    assert sum(len(d.generated_tokens) for d in deltas) == 4


def test_result_handler_runs_on_the_registering_event_loop():
    """Registered from a coroutine, the callback runs on that loop's thread (call_soon_threadsafe), as in
    transformers; registered from plain code, on the engine thread."""
    model = tiny_model("qwen3")
    with init_continuous_batching(model, continuous_batching_config=CACHE) as manager:

        async def main() -> list[tuple[str, bool]]:
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            seen = []

            def handler(output):
                seen.append((threading.current_thread().name, asyncio.get_running_loop() is loop))
                if output.is_finished:
                    done.set_result(None)

            request_id = manager.add_request([1, 2, 3], max_new_tokens=3, streaming=True, sampling=GREEDY)
            manager.register_result_handler(request_id, handler)
            await asyncio.wait_for(done, 30)
            return seen

        seen = asyncio.run(main())
        assert seen and all(entry == (threading.main_thread().name, True) for entry in seen)

        threads = []
        finished = threading.Event()
        request_id = manager.add_request([4, 5], max_new_tokens=2, sampling=GREEDY)
        manager.register_result_handler(
            request_id, lambda out: (threads.append(threading.current_thread()), finished.set())
        )
        assert finished.wait(30)
        assert threads[0].name == "rollout-engine" and threads[0] is not threading.main_thread()


def test_add_requests_iteration_destroy():
    model = tiny_model("qwen3")
    prompts = make_prompts(4, 3, 8, seed=2)
    manager = init_continuous_batching(model, GenerationConfig(do_sample=False, max_new_tokens=3), CACHE)
    assert manager.generation_config.max_new_tokens == 3
    manager.start()
    ids = manager.add_requests(prompts)
    assert ids == [f"req_{i}" for i in range(4)]
    seen = []
    for output in manager:
        seen.append(output.request_id)
        if len(seen) == 4:
            break
    assert sorted(seen) == ids
    manager.destroy()
    manager.destroy()  # idempotent
    assert not manager.is_running() and list(manager) == []
    with pytest.raises(RuntimeError):
        manager.start()


def test_pause_holds_the_loop_and_keeps_requests_in_flight():
    """Inside `pause()` the engine takes no step; requests in flight keep their cache and finish after it, with the
    tokens transformers' generate gives."""
    model = tiny_model("qwen3")
    reference = reference_copy(model)
    prompt = make_prompts(1, 6, 6, seed=3)[0]
    with init_continuous_batching(model, continuous_batching_config=CACHE) as manager:
        with pytest.raises(RuntimeError):
            init_continuous_batching(tiny_model("qwen3"), continuous_batching_config=CACHE).pause().__enter__()
        request_id = manager.add_request(prompt, max_new_tokens=40, sampling=GREEDY, streaming=True)
        first = manager.get_result(request_id, timeout=30)  # running now
        with manager.pause(timeout=30):
            steps = manager.engine.counters.steps
            time.sleep(0.3)
            assert manager.engine.counters.steps == steps
        rest = list(manager.request_id_iter(request_id, timeout=30))
    tokens = first.generated_tokens + [t for delta in rest for t in delta.generated_tokens]
    expected = reference.generate(
        torch.tensor([prompt]), generation_config=GenerationConfig(do_sample=False, max_new_tokens=40)
    )[0, len(prompt) :].tolist()
    assert tokens == expected


def test_generate_batch_persistent_manager_reuses_its_engine():
    model = tiny_model("qwen3")
    prompts = make_prompts(2, 3, 8, seed=4)

    def run(config=CACHE, **kwargs):
        return generate_batch(
            model,
            prompts,
            sampling=GREEDY,
            max_new_tokens=4,
            continuous_batching_config=config,
            progress_bar=False,
            **kwargs,
        )

    fresh = run()
    assert cached_engine(model) is None
    kept = run(persistent_manager=True)
    engine = cached_engine(model)
    assert engine.warmed_up  # warmup=True (the default) ran once, on the new engine
    again = run(persistent_manager=True)
    assert cached_engine(model) is engine
    assert [o.generated_tokens for o in fresh.values()] == [o.generated_tokens for o in kept.values()]
    assert [o.generated_tokens for o in again.values()] == [o.generated_tokens for o in fresh.values()]
    other = ContinuousBatchingConfig(num_blocks=64, block_size=8)
    run(other, persistent_manager=True)  # other settings: a new engine
    assert cached_engine(model) is not engine
    release_cached_engine(model)
    assert cached_engine(model) is None
    cold = run(persistent_manager=True, warmup=False)
    assert not cached_engine(model).warmed_up and len(cold) == 2
    release_cached_engine(model)


def test_a_persistent_engine_gives_the_model_back_and_sees_new_weights():
    """Between persistent calls the model is the caller's again (attention implementation, training mode); weights
    changed in place are used by the next call (no stale prefix cache), and so is a changed model generation
    config."""
    model = tiny_model("qwen3")
    model.train()
    attention = model.config._attn_implementation
    prompts = make_prompts(2, 8, 8, seed=5)

    def run(**kwargs):
        outputs = generate_batch(
            model,
            prompts,
            sampling=kwargs.pop("sampling", GREEDY),
            continuous_batching_config=CACHE,
            progress_bar=False,
            persistent_manager=True,
            **kwargs,
        )
        return [o.generated_tokens for o in outputs.values()]

    before = run(max_new_tokens=6)
    assert model.training and model.config._attn_implementation == attention
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)  # an optimizer step, in place
    after = run(max_new_tokens=6)
    fresh = generate_batch(
        copy.deepcopy(model),
        prompts,
        sampling=GREEDY,
        max_new_tokens=6,
        continuous_batching_config=CACHE,
        progress_bar=False,
    )
    assert after == [o.generated_tokens for o in fresh.values()] != before
    model.generation_config.max_new_tokens = 3
    assert [len(t) for t in run(sampling=None)] == [3, 3]
    release_cached_engine(model)
    assert model.training and model.config._attn_implementation == attention


def test_pause_nests_and_refuses_what_would_wait_on_itself():
    """A thread inside a pause may pause again (re-entrant); waiting for a weight update there would wait for the
    loop it holds: refused at once. stop() from a result handler ends the loop instead of failing to join itself."""
    model = tiny_model("qwen3")
    manager = init_continuous_batching(model, continuous_batching_config=CACHE).start()
    with manager.pause(timeout=30):
        with manager.pause(timeout=1):
            steps = manager.engine.counters.steps
        with pytest.raises(RuntimeError, match="inside this thread's pause"):
            manager.update_weights({}, timeout=1)
        assert manager.engine.counters.steps == steps
    request_id = manager.add_request([1, 2, 3], max_new_tokens=2, sampling=GREEDY)
    manager.register_result_handler(request_id, lambda output: manager.stop())
    manager.join(timeout=30)
    assert not manager.is_running()
    with pytest.raises(TypeError, match="add_request"):
        manager.add_requests([[1]], request_id="x")


def test_generate_batch_takes_what_a_tokenizer_returns():
    """A padded BatchEncoding (tokenizer(texts, padding=True)) gives the same completions as the unpadded id lists."""
    from rollout.presets import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_model("qwen3")
    texts = ["abc: ", "a much longer prompt: "]
    expected = generate_batch(
        model, [tokenizer(t)["input_ids"] for t in texts], sampling=GREEDY, max_new_tokens=4, progress_bar=False
    )
    for side in ("left", "right"):
        tokenizer.padding_side = side
        encoded = tokenizer(texts, padding=True, return_tensors="pt")
        assert (encoded["attention_mask"] == 0).any()
        outputs = generate_batch(model, encoded, sampling=GREEDY, max_new_tokens=4, progress_bar=False)
        assert [o.prompt_ids for o in outputs.values()] == [o.prompt_ids for o in expected.values()]
        assert [o.generated_tokens for o in outputs.values()] == [o.generated_tokens for o in expected.values()]


def test_join_takes_transformers_arguments(caplog):
    """transformers' `join(stop_trigger_time, timeout)`: the time of the stop first (how long the thread took to end
    is logged after it), the timeout second; a join whose timeout ends first says so. Neither may be NaN."""
    import inspect

    from transformers.generation.continuous_batching import ContinuousBatchingManager as TransformersManager

    from rollout.config import FieldError

    theirs = list(inspect.signature(TransformersManager.join).parameters)
    manager = init_continuous_batching(tiny_model("qwen3"), continuous_batching_config=CACHE).start()
    assert list(inspect.signature(manager.join).parameters) == theirs[1:]  # (self is bound)
    with pytest.raises(FieldError, match="timeout"):
        manager.join(timeout=float("nan"))
    with pytest.raises(FieldError, match="stop_trigger_time"):
        manager.join("now")
    with caplog.at_level("WARNING", logger="rollout"):
        manager.join(time.perf_counter(), 0.01)  # not stopped: still running after the timeout
    assert "did not end within join's timeout" in caplog.text
    stop_trigger_time = time.perf_counter()
    manager.stop(block=False)
    with caplog.at_level("INFO", logger="rollout"):
        manager.join(stop_trigger_time, timeout=30)
    assert not manager.is_running() and "engine thread stopped" in caplog.text


def test_the_uptime_stops_counting_when_the_manager_stops():
    """uptime_s went on growing after stop(), so a stopped worker's tokens per second (tokens / uptime) decayed."""
    manager = init_continuous_batching(tiny_model("qwen3"), continuous_batching_config=CACHE).start()
    request_id = manager.add_request([1, 2, 3], max_new_tokens=2, sampling=GREEDY)
    assert manager.get_result(request_id, timeout=30).is_finished()
    manager.stop()
    first = manager.stats()["uptime_s"]
    time.sleep(0.05)
    assert manager.stats()["uptime_s"] == first > 0
