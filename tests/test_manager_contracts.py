"""Contracts of the manager and engine front door that a careless implementation gets wrong: requests own a copy of
their settings, a stopped manager refuses work instead of hanging, handlers miss nothing, ids and prompts are never
silently reinterpreted, generation configs merge like transformers' `generate`, and engines sharing a model do not
break each other."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import GenerationConfig

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout import (
    ContinuousBatchingConfig,
    GroupSpec,
    QueueFullError,
    SamplingParams,
    generate_batch,
    init_continuous_batching,
)

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 10.0
GREEDY = SamplingParams(do_sample=False, stop_token_ids=())


def manager_for(model=None, generation_config=None, **config):
    config = ContinuousBatchingConfig(**{"num_blocks": 256, "block_size": 4, **config})
    return init_continuous_batching(model if model is not None else tiny_model(), generation_config, config)


def specs(group_ids, prompts, max_new_tokens):
    return [GroupSpec(i, prompt, GREEDY, max_new_tokens=max_new_tokens) for i, prompt in zip(group_ids, prompts)]


def greedy_reference(model, prompt, length):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=length,
        min_new_tokens=length,
    )
    return out[0, len(prompt) :].tolist()


def test_sampling_params_are_copied_at_submit():
    """Changing a SamplingParams object after add_request does not change requests already queued."""
    model = tiny_model()
    params = SamplingParams(stop_token_ids=(), max_new_tokens=8)
    with manager_for(model) as manager:
        for seed in range(3):
            params.seed = seed
            manager.add_request([1, 2, 3, 4], request_id=f"s{seed}", sampling=params)
        got = {seed: manager.get_result(f"s{seed}", timeout=TIMEOUT).generated_tokens for seed in range(3)}
    expected = generate_batch(
        model,
        [[1, 2, 3, 4]] * 3,
        progress_bar=False,
        sampling=[SamplingParams(stop_token_ids=(), max_new_tokens=8, seed=s) for s in range(3)],
    )
    assert [got[s] for s in range(3)] == [expected[f"req_{s}"].generated_tokens for s in range(3)]
    assert len({tuple(t) for t in got.values()}) == 3


def test_stopped_manager_refuses_requests_and_never_blocks():
    """After stop(), add_request raises and get_result / request_id_iter answer at once."""
    manager = manager_for().start()
    manager.stop(block=True, timeout=TIMEOUT)
    with pytest.raises(RuntimeError, match="stopped"):
        manager.add_request([1, 2, 3], request_id="late", sampling=GREEDY)
    assert manager.get_result(timeout=None) is None
    with pytest.raises(ValueError, match="request_id: 'late' has no output left to read: it was never added"):
        list(manager.request_id_iter("late"))  # the add was refused: a typo'd id is named, not an empty iteration


def test_stop_without_hard_stop_finishes_what_was_added_as_transformers_does():
    """transformers' `stop()` flushes: the requests added run to their end, then the thread stops. rollout's default
    ends them with "abort"; `hard_stop=False` flushes as transformers does, its tokens those of `generate`, and
    refuses what comes after; `keep_for_next_session` is refused by name (a manager does not restart)."""
    model = tiny_model()
    prompts = make_prompts(3, 4, 9, seed=2)
    manager = manager_for(model).start()
    for index, prompt in enumerate(prompts):
        manager.add_request(prompt, request_id=f"r{index}", sampling=GREEDY, max_new_tokens=24)
    with pytest.raises(ValueError, match="keep_for_next_session: not supported"):
        manager.stop(keep_for_next_session=True)
    manager.stop(block=True, timeout=30, hard_stop=False)
    assert not manager.is_running()
    with pytest.raises(RuntimeError, match="stopped"):
        manager.add_request([1, 2, 3], request_id="late", sampling=GREEDY)
    outputs = {}
    while (output := manager.get_result(timeout=0)) is not None:
        outputs[output.request_id] = output
    assert sorted(outputs) == ["r0", "r1", "r2"]
    for index, prompt in enumerate(prompts):
        assert outputs[f"r{index}"].finish_reason == "length"
        assert outputs[f"r{index}"].generated_tokens == greedy_reference(model, prompt, 24)
    with pytest.raises(RuntimeError, match="stopped"):
        manager.start()


def test_a_hard_stop_ends_what_runs_with_abort():
    manager = manager_for().start()
    manager.add_request([1, 2, 3], request_id="long", sampling=GREEDY, max_new_tokens=1000)
    manager.stop(block=True, timeout=30, hard_stop=True)
    assert manager.get_result("long", timeout=TIMEOUT).finish_reason == "abort"


def test_handler_registered_after_outputs_queued_receives_them():
    """Outputs that arrived before register_result_handler go to the handler, not lost in the queue."""
    received, done = [], threading.Event()
    with manager_for() as manager:
        manager.add_request([5, 6, 7], request_id="h", max_new_tokens=3, streaming=True, sampling=GREEDY)
        manager.add_request([5, 6, 7, 8], request_id="blocker", max_new_tokens=30, sampling=GREEDY)
        assert manager.get_result("blocker", timeout=TIMEOUT) is not None  # "h" finished long before
        manager.register_result_handler("h", lambda o: (received.append(o), o.is_finished and done.set()))
        assert done.wait(TIMEOUT)
    assert sum(len(o.generated_tokens) for o in received) == 3


def test_prompt_shapes_are_never_reinterpreted():
    """A (1, L) tensor is one prompt; a 2-D batch, a float tensor or a bare int is refused naming input_ids."""
    model = tiny_model()
    reference = reference_copy(model)
    with manager_for(model) as manager:
        for bad in (torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([1.0, 2.0]), 5, None):
            with pytest.raises(ValueError, match="input_ids"):
                manager.add_request(bad, sampling=GREEDY)
        manager.add_request(torch.tensor([[1, 2, 3]]), request_id="row", max_new_tokens=4, sampling=GREEDY)
        assert manager.get_result("row", timeout=TIMEOUT).generated_tokens == greedy_reference(reference, [1, 2, 3], 4)


def test_a_batch_of_groups_is_added_all_or_none():
    """`add_groups` checks every prompt before queueing any: a batch refused at its last prompt (an id past the
    vocabulary, a bool, a float) or by a queue that cannot take it all leaves nothing queued, and its ids free."""
    model = tiny_model()
    reference = reference_copy(model)
    vocab = model.config.vocab_size
    with manager_for(model, max_queue_size=3) as manager:
        for bad, reason in (([vocab], f"prompt 2 of the batch: {vocab} at position 0"), ([1, True], "True at")):
            with pytest.raises(ValueError, match=reason) as raised:
                manager.add_groups(specs(["a", "b", "c"], [[1, 2], [3, 4], bad], max_new_tokens=2))
            assert raised.value.field == "prompt_ids"
        with pytest.raises(QueueFullError):
            manager.add_groups(specs(list("abcd"), [[1, 2]] * 4, max_new_tokens=2))
        assert manager.stats()["queued"] == 0 and manager.stats()["prefill_tokens"] == 0
        manager.add_groups(specs(["a", "b", "c"], [[1, 2], [3, 4], [5, 6]], max_new_tokens=3))
        for group_id, prompt in zip("abc", ([1, 2], [3, 4], [5, 6])):
            generated = manager.get_result(group_id, timeout=TIMEOUT).generated_tokens
            assert generated == greedy_reference(reference, prompt, 3)


def test_generate_batch_ignores_serving_queue_limit():
    """max_queue_size bounds a serving queue; generate_batch with more prompts than that still completes."""
    outputs = generate_batch(
        tiny_model(),
        make_prompts(5, 3, 6),
        progress_bar=False,
        max_new_tokens=2,
        sampling=GREEDY,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, block_size=4, max_queue_size=2),
    )
    assert len(outputs) == 5 and all(o.finish_reason == "length" for o in outputs.values())


def test_two_engines_on_one_model_and_training_mode_restored():
    """Closing one engine leaves the other generating correctly; the last close restores the attention
    implementation and the training mode the caller had set."""
    model = tiny_model("llama")
    reference = reference_copy(model)
    model.train()
    original = model.config._attn_implementation
    first, second = make_engine(model), make_engine(model)
    first.close()
    prompt = make_prompts(1, 9, 9)[0]
    second.add_request("x", prompt, GREEDY, max_new_tokens=6)
    assert run_to_completion(second)["x"].generated_tokens == greedy_reference(reference, prompt, 6)
    assert model.config._attn_implementation == "rollout_paged"
    second.close()
    assert model.config._attn_implementation == original and model.training


def test_generation_config_merges_with_models_own():
    """A GenerationConfig that does not set eos keeps the model's EOS as a stop token, and sampling gets
    transformers' top_k=50 default, as `generate` would."""
    model = tiny_model()
    reference = reference_copy(model)
    prompt = make_prompts(1, 7, 7)[0]
    first_token = greedy_reference(reference, prompt, 1)[0]
    model.generation_config.eos_token_id = first_token
    with manager_for(model, GenerationConfig(do_sample=False, max_new_tokens=5)) as manager:
        manager.add_request(prompt, request_id="eos")
        output = manager.get_result("eos", timeout=TIMEOUT)
    assert (output.generated_tokens, output.finish_reason) == ([first_token], "stop")
    sampling_manager = manager_for(model, GenerationConfig(do_sample=True))
    assert sampling_manager.engine.intake.default_sampling.top_k == 50
    assert sampling_manager.engine.intake.default_sampling.stop_token_ids == (first_token,)
    sampling_manager.stop()


def test_request_id_iter_timeout_raises():
    """A stream that produces nothing within the timeout raises TimeoutError instead of looking finished."""
    with manager_for() as manager:
        manager.add_request([1, 2, 3], request_id="slow", max_new_tokens=900, sampling=GREEDY)
        with pytest.raises(TimeoutError):
            list(manager.request_id_iter("slow", timeout=0.01))
        manager.cancel_request("slow")


def test_request_id_iter_names_a_sample_read_already_and_a_request_a_handler_takes():
    """Both would wait forever (the default timeout is None): a sample whose outputs were all read while its sibling
    still has some, and a request whose outputs go to a registered handler."""
    with manager_for() as manager:
        group = manager.add_request([1, 2, 3], n=2, max_new_tokens=3, sampling=GREEDY)
        first = list(manager.request_id_iter(f"{group}#0", timeout=TIMEOUT))
        assert first and first[-1].is_finished
        with pytest.raises(ValueError, match=f"request_id: '{group}#0' has no output left to read"):
            list(manager.request_id_iter(f"{group}#0"))
        assert [o.request_id for o in manager.request_id_iter(f"{group}#1", timeout=TIMEOUT)][-1] == f"{group}#1"
        handled = threading.Event()
        manager.register_result_handler("taken", lambda output: output.is_finished and handled.set())
        manager.add_request([1, 2, 3], request_id="taken", max_new_tokens=900, sampling=GREEDY)  # still running
        with pytest.raises(ValueError, match="'taken': its outputs go to the handler registered for it"):
            list(manager.request_id_iter("taken"))
        manager.cancel_request("taken")
        assert handled.wait(TIMEOUT)


def test_request_id_iter_before_start_says_the_manager_is_not_running():
    manager = manager_for()  # not started: the request waits, and nothing can come
    manager.add_request([1, 2, 3], request_id="early", max_new_tokens=2, sampling=GREEDY)
    with pytest.raises(TimeoutError, match="'early': the manager is not running \\(start\\(\\) it first"):
        list(manager.request_id_iter("early", timeout=3))
    manager.stop()


def test_request_ids_cannot_look_like_sample_ids():
    """Sample ids of a group are "<id>#<i>", so a user id containing "#" is refused: cancel_request("job#1") can
    then only ever mean sample 1 of group "job"."""
    with manager_for() as manager:
        with pytest.raises(ValueError, match="request_id"):
            manager.add_request([1, 2], request_id="job#1", sampling=GREEDY)
        manager.add_request([1, 2, 3], request_id="job", n=2, max_new_tokens=900, sampling=GREEDY)
        manager.cancel_request("job#1")
        results = [manager.get_result("job", timeout=TIMEOUT) for _ in range(2)]
    assert [r.finish_reason for r in results] == ["abort", "abort"]


def test_unsupported_layer_types_are_refused():
    """A model with recurrent/linear layers would need state the engine does not keep: refused, naming them."""
    model = tiny_model()
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="linear_attention"):
        make_engine(model)
