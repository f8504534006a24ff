"""Engines that a model developer shares without seeing it: the engine `generate_batch(..., persistent_manager=True)`
keeps on the model and a `ColocatedEngine` serve one thread at a time (a second thread is refused by name, never
mixed in: two calls stepping one engine returned each other's completions under their own request ids); an engine
closed by its holder or one that fails to build leaves the model as the caller had it; and a wait given a timeout
that is no number of seconds is refused instead of spinning."""

from __future__ import annotations

import threading

import pytest

from conftest import tiny_model
from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch, init_continuous_batching
from rollout.engine import engine as engine_module
from rollout.engine import generate as generate_module
from rollout.engine.generate import cached_engine, release_cached_engine
from trainer_bridge import ColocatedEngine, PromptGroup

pytestmark = pytest.mark.timeout(120)
CONFIG = ContinuousBatchingConfig(num_blocks=64, block_size=16)
SHORT = SamplingParams(max_new_tokens=1, stop_token_ids=())
LONG = SamplingParams(max_new_tokens=12, stop_token_ids=())


def on_another_thread(function):
    """What `function()` returned or raised, run to its end on a thread of its own."""
    outcome = {}

    def run():
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - the test looks at it
            outcome["value"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    return outcome["value"]


def test_the_kept_engine_serves_one_call_at_a_time(monkeypatch):
    model = tiny_model()
    generate_batch(model, [[1]], sampling=SHORT, continuous_batching_config=CONFIG, progress_bar=False,
                   persistent_manager=True)  # fmt: skip
    seen = {}
    after_step = generate_module.SampleProgress.after_step

    def meanwhile(progress, finished):  # the first call's req_0 finished, its req_1 runs: another thread calls now
        if finished and not seen:
            kept = dict(sampling=SHORT, continuous_batching_config=CONFIG, progress_bar=False)
            seen["kept"] = on_another_thread(lambda: generate_batch(model, [[9, 9]], persistent_manager=True, **kept))
            seen["own"] = on_another_thread(lambda: generate_batch(model, [[8, 8]], **kept))
            seen["release"] = on_another_thread(lambda: release_cached_engine(model))
        after_step(progress, finished)

    monkeypatch.setattr(generate_module.SampleProgress, "after_step", meanwhile)
    outputs = generate_batch(model, [[1, 2, 3], [4, 5, 6]], sampling=[SHORT, LONG], continuous_batching_config=CONFIG,
                             progress_bar=False, persistent_manager=True)  # fmt: skip
    assert {key: (o.prompt_ids, len(o.generated_tokens)) for key, o in outputs.items()} == {
        "req_0": ([1, 2, 3], 1),
        "req_1": ([4, 5, 6], 12),
    }
    assert isinstance(seen["kept"], RuntimeError) and "one call at a time" in str(seen["kept"])
    assert seen["own"]["req_0"].prompt_ids == [8, 8]  # a plain call runs on its own engine, the kept one untouched
    assert isinstance(seen["release"], RuntimeError) and "another thread" in str(seen["release"])
    assert cached_engine(model) is not None and model.config._attn_implementation != "rollout_paged"
    release_cached_engine(model)


def test_a_kept_engine_closed_by_its_holder_is_replaced_and_gives_the_model_back():
    model = tiny_model()
    model.train()
    kept = dict(sampling=SHORT, continuous_batching_config=CONFIG, progress_bar=False, persistent_manager=True)
    generate_batch(model, [[1, 2, 3]], **kept)
    cached_engine(model).close()
    outputs = generate_batch(model, [[1, 2, 3]], **kept)
    assert len(outputs["req_0"].generated_tokens) == 1
    release_cached_engine(model)
    assert model.config._attn_implementation != "rollout_paged" and model.training


def test_an_engine_that_fails_to_build_gives_the_model_back(monkeypatch):
    model = tiny_model()
    model.train()
    attention = model.config._attn_implementation

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_module, "WeightTable", interrupted)  # the last part built, after the model runner
    with pytest.raises(KeyboardInterrupt):
        generate_batch(model, [[1, 2, 3]], sampling=SHORT, continuous_batching_config=CONFIG, progress_bar=False)
    assert model.config._attn_implementation == attention and model.training


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, "5", True])
def test_a_wait_whose_timeout_is_no_number_of_seconds_is_refused(timeout):
    with init_continuous_batching(tiny_model(), continuous_batching_config=CONFIG) as manager:
        request_id = manager.add_request([1, 2, 3], sampling=LONG)
        with pytest.raises(ValueError, match="timeout"):
            manager.get_result("no-such-request", timeout=timeout)  # NaN: spun a core until the manager stopped
        with pytest.raises(ValueError, match="timeout"):
            manager.request_id_iter(request_id, timeout=timeout)
        assert manager.get_result(request_id, timeout=60).finish_reason == "length"


def test_a_colocated_engine_refuses_a_second_thread_while_a_round_runs(monkeypatch):
    model = tiny_model()
    engine = ColocatedEngine(model, CONFIG)
    sampling = {"max_new_tokens": 6, "stop_token_ids": []}
    seen = {}
    step = engine.engine.step

    def meanwhile():
        if not seen:
            seen["generate"] = on_another_thread(lambda: engine.generate([PromptGroup([7, 7], sampling=sampling)]))
            seen["sleep"] = on_another_thread(engine.sleep)
            seen["close"] = on_another_thread(engine.close)
        return step()

    monkeypatch.setattr(engine.engine, "step", meanwhile)
    [result] = engine.generate([PromptGroup([1, 2, 3], n=2, sampling=sampling)])
    assert [len(c.token_ids) for c in result.completions] == [6, 6] and result.prompt_ids == [1, 2, 3]
    for what in ("generate", "sleep", "close"):
        assert isinstance(seen[what], RuntimeError) and "one thread at a time" in str(seen[what]), what
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.set_policy_version(3)


def test_an_engine_dropped_unclosed_gives_the_model_back_when_freed(no_leaked_blocks):
    """A manager built and dropped without stop(): its engine is freed by refcount, and what it put on the model
    (paged attention, eval mode, the fp32 head's copy in a forward hook) goes with it, with no garbage collection."""
    import gc

    import torch

    model = tiny_model(dtype=torch.bfloat16)
    model.train()
    head = model.get_output_embeddings()
    config = ContinuousBatchingConfig(num_blocks=64, block_size=16, fp32_logits=True)
    gc.collect()
    gc.disable()
    try:
        manager = init_continuous_batching(model, continuous_batching_config=config)
        assert model.config._attn_implementation == "rollout_paged" and head._forward_hooks
        no_leaked_blocks.clear()  # the conftest's hold on the engine
        del manager
        assert model.config._attn_implementation != "rollout_paged" and model.training and not head._forward_hooks
    finally:
        gc.enable()


def test_numpy_seconds_are_seconds():
    """A timeout given as a numpy number (a config read with numpy) is a number of seconds, as queue.get takes it: the
    new checks had refused np.int64(30) for RolloutClient(timeout=...) and np.float32 for get_result's."""
    import numpy as np

    from rollout.validation import check_timeout, is_seconds

    assert is_seconds(np.int64(30)) and is_seconds(np.float32(0.5))
    check_timeout(np.float32(0.5))
    assert not is_seconds(np.float32("nan")) and not is_seconds(np.int64(-1)) and not is_seconds(np.bool_(True))


def test_a_plain_call_is_not_refused_when_another_thread_claims_the_kept_engine_meanwhile(monkeypatch):
    """A plain call (persistent_manager=False) gets its own engine even when another thread claims the idle kept one
    between the slot's check and its release (that claim failed the plain call with a RuntimeError)."""
    from rollout.engine import kept_engines

    model = tiny_model()
    kwargs = dict(sampling=SHORT, continuous_batching_config=CONFIG, progress_bar=False)
    generate_batch(model, [[5, 9, 14]], persistent_manager=True, **kwargs)
    kept = kept_engines.cached_engine(model)
    release = kept_engines.release_cached_engine

    def claimed_first(held_model):  # another thread's persistent call claims the idle kept engine right now
        kept_engines._slot(held_model).user = -1
        return release(held_model)

    monkeypatch.setattr(kept_engines, "release_cached_engine", claimed_first)
    assert len(generate_batch(model, [[7, 7, 7]], **kwargs)) == 1
    assert kept.runner.closed and kept_engines.cached_engine(model) is None  # the idle kept engine closed, as before
