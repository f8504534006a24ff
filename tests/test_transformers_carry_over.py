"""Code written for transformers' continuous batching carries over unchanged: positional arguments of
`generate_batch` and `add_request` mean what they mean in transformers, and transformers' "no EOS" (`eos_token_id=-1`,
which its `init_continuous_batching` writes into a GenerationConfig that has none) is honoured as `generate` honours
it, not refused. References are transformers' own signatures, its manager and `model.generate`."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager as TheirManager
from transformers.generation.utils import GenerationMixin

from conftest import reference_copy, tiny_model
from rollout import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    FieldError,
    generate_batch,
    init_continuous_batching,
)

CACHE = ContinuousBatchingConfig(num_blocks=64, block_size=4)
PROMPT = [1, 2, 3, 4]


def _greedy_reference(model: torch.nn.Module, max_new_tokens: int, eos_token_id) -> list[int]:
    """transformers' `generate`, greedy, on an independent copy."""
    reference = reference_copy(model)
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
    with torch.no_grad():
        out = reference.generate(torch.tensor([PROMPT]), generation_config=config, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


def _positional_names(function, skip: int, stop: str) -> list[str]:
    names = [p.name for p in inspect.signature(function).parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    names = names[skip:]
    return names[: names.index(stop) + 1]


def test_generate_batch_positional_arguments_mean_what_they_mean_in_transformers():
    """`model.generate_batch(inputs, gc, cbc, record_timestamps, progress_bar, ...)` is rollout's
    `generate_batch(model, inputs, gc, cbc, record_timestamps, progress_bar, ...)`: a True fourth argument after the
    inputs records timestamps in both."""
    theirs = _positional_names(GenerationMixin.generate_batch, 1, "warmup")  # after self
    ours = _positional_names(generate_batch, 1, "warmup")  # after model
    assert ours == theirs
    model = tiny_model()
    config = GenerationConfig(do_sample=False, max_new_tokens=3, eos_token_id=None)
    outputs = generate_batch(model, [PROMPT], config, CACHE, True, False)
    output = outputs["req_0"]
    assert output.timestamps is not None and len(output.timestamps) == len(output.generated_tokens) == 3


def test_add_request_positional_arguments_mean_what_they_mean_in_transformers():
    """transformers' `add_request(input_ids, request_id, max_new_tokens, streaming, record_timestamps,
    eos_token_id)`: the same positions here, so `add_request(ids, None, 3, False, True)` records timestamps."""
    assert _positional_names(TheirManager.add_request, 1, "eos_token_id") == [
        "input_ids",
        "request_id",
        "max_new_tokens",
        "streaming",
        "record_timestamps",
        "eos_token_id",
    ]
    ours = _positional_names(ContinuousBatchingManager.add_request, 1, "eos_token_id")
    assert ours == _positional_names(TheirManager.add_request, 1, "eos_token_id")
    model = tiny_model()
    config = GenerationConfig(do_sample=False, eos_token_id=None)
    expected = _greedy_reference(model, 3, None)
    with init_continuous_batching(model, config, CACHE) as manager:
        request_id = manager.add_request(PROMPT, None, 3, False, True)
        output = manager.get_result(request_id, timeout=60)
    assert output.generated_tokens == expected
    assert output.timestamps is not None and len(output.timestamps) == 3


@pytest.mark.parametrize("eos", [-1, [-1]], ids=["int", "list"])
def test_negative_eos_token_id_means_no_eos_as_in_transformers(eos):
    """A GenerationConfig with transformers' "no EOS" (-1) generates to max_new_tokens as `generate` does, both in
    `generate_batch` and in a manager, instead of being refused."""
    model = tiny_model()
    model.generation_config.eos_token_id = _greedy_reference(model, 3, None)[1]  # a model EOS that -1 must replace
    expected = _greedy_reference(model, 6, eos)
    assert len(expected) == 6
    config = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=eos)
    outputs = generate_batch(model, [PROMPT], config, CACHE, progress_bar=False)
    assert outputs["req_0"].generated_tokens == expected
    with init_continuous_batching(model, config, CACHE) as manager:
        output = manager.get_result(manager.add_request(PROMPT), timeout=60)
    assert output.generated_tokens == expected


def test_config_left_by_transformers_manager_is_accepted():
    """transformers' `init_continuous_batching` on a model without an EOS writes -1 into its generation config; the
    same model then serves rollout as it served transformers."""
    model = tiny_model()
    model.generation_config.eos_token_id = None
    model.generation_config.do_sample = False
    reference = reference_copy(model)
    reference.init_continuous_batching(continuous_batching_config=None)  # built, never started
    assert reference.generation_config.eos_token_id == -1
    model.generation_config = reference.generation_config
    outputs = generate_batch(model, [PROMPT], max_new_tokens=4, continuous_batching_config=CACHE, progress_bar=False)
    assert outputs["req_0"].generated_tokens == _greedy_reference(model, 4, None)


def test_add_request_eos_with_a_negative_id_stops_only_at_the_others():
    """`add_request(..., eos_token_id=[-1, t])` stops at t, as transformers' request (which drops negative ids) and
    `generate` do."""
    model = tiny_model()
    stop = _greedy_reference(model, 4, None)[2]
    expected = _greedy_reference(model, 8, [-1, stop])
    assert expected[-1] == stop and len(expected) < 8
    config = GenerationConfig(do_sample=False, eos_token_id=None)
    with init_continuous_batching(model, config, CACHE) as manager:
        single = manager.get_result(manager.add_request(PROMPT, max_new_tokens=8, eos_token_id=-1), timeout=60)
        mixed = manager.get_result(manager.add_request(PROMPT, max_new_tokens=8, eos_token_id=[-1, stop]), timeout=60)
    assert mixed.generated_tokens == expected and mixed.finish_reason == "stop"
    assert single.generated_tokens == _greedy_reference(model, 8, -1)


@pytest.mark.parametrize("eos", [True, 2.0, "2", 10**7, [2, 10**7]], ids=["bool", "float", "str", "huge", "list"])
def test_a_bad_add_request_eos_token_id_is_named_as_given(eos):
    """A bad `eos_token_id` is refused naming `eos_token_id`, the argument the caller gave (it became
    `stop_token_ids` inside and was refused under that name, which the caller never wrote)."""
    with init_continuous_batching(tiny_model(), GenerationConfig(do_sample=False), CACHE) as manager:
        with pytest.raises(FieldError) as refused:
            manager.add_request(PROMPT, None, 3, False, False, eos)
    assert refused.value.field == "eos_token_id"


def test_add_request_eos_token_id_with_stop_token_ids_is_refused_not_dropped():
    """`eos_token_id` and the `stop_token_ids` keyword both set the request's stop tokens: given together, one was
    silently dropped (the request ran past a stop token it was given). Refused by name instead."""
    model = tiny_model()
    stop = _greedy_reference(model, 4, None)[2]  # a token greedy decoding reaches
    with init_continuous_batching(model, GenerationConfig(do_sample=False, eos_token_id=None), CACHE) as manager:
        with pytest.raises(FieldError, match="stop_token_ids") as refused:
            manager.add_request(PROMPT, max_new_tokens=8, eos_token_id=-1, stop_token_ids=[stop])
        alone = manager.get_result(manager.add_request(PROMPT, max_new_tokens=8, stop_token_ids=[stop]), timeout=60)
    assert refused.value.field == "eos_token_id"
    assert alone.generated_tokens == _greedy_reference(model, 8, stop)  # stop_token_ids alone: transformers' eos


def test_the_context_manager_takes_transformers_positions_and_finishes_the_requests_on_exit():
    """`model.continuous_batching_context_manager(gc, block, timeout, cbc, persistent_manager, warmup)` is
    `continuous_batching_context_manager(model, gc, block, timeout, cbc, persistent_manager, warmup)`, and its exit is
    transformers': a request added and never read runs to its end (transformers' `stop()` flushes), where rollout's
    `with init_continuous_batching(...)` ends it with "abort"."""
    from rollout import continuous_batching_context_manager

    theirs = _positional_names(GenerationMixin.continuous_batching_context_manager, 1, "warmup")
    assert _positional_names(continuous_batching_context_manager, 1, "warmup") == theirs
    model = tiny_model()
    config = GenerationConfig(do_sample=False, eos_token_id=None)
    expected = _greedy_reference(model, 40, None)
    with continuous_batching_context_manager(model, config, True, 60, CACHE, False, False) as manager:
        request_id = manager.add_request(PROMPT, max_new_tokens=40)
    output = manager.get_result(request_id, timeout=0)
    assert output is not None and output.finish_reason == "length"
    assert output.generated_tokens == expected


def test_the_context_manager_ends_the_requests_when_the_block_raises_and_refuses_a_persistent_manager():
    """An exception in the block ends the requests at once (nothing waits on a long tail after an error); a
    persistent manager, which rollout does not keep, is refused by name before anything is built."""
    from rollout import continuous_batching_context_manager

    model = tiny_model()
    config = GenerationConfig(do_sample=False, eos_token_id=None)
    with pytest.raises(KeyError):
        with continuous_batching_context_manager(model, config, continuous_batching_config=CACHE) as manager:
            with manager.pause():  # raised while paused: the request cannot finish before the exception
                request_id = manager.add_request(PROMPT, max_new_tokens=200)
                raise KeyError("the caller's own error")
    assert not manager.is_running()
    output = manager.get_result(request_id, timeout=0)
    assert output is not None and output.finish_reason == "abort"
    with pytest.raises(ValueError, match="persistent_manager"):
        with continuous_batching_context_manager(model, persistent_manager=True):
            pass


def test_torch_manual_seed_repeats_sampled_generate_batch_as_it_repeats_transformers_sampling():
    """transformers samples from torch's default generator, so `torch.manual_seed` (or `set_seed`) before a call
    repeats its samples; rollout's generate_batch draws unseeded requests' seeds from that generator (it drew fresh
    randomness from the system: the same script sampled other tokens on every run)."""
    model = tiny_model("qwen3", seed=0)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=6)

    def theirs(seed: int) -> list[int]:
        torch.manual_seed(seed)
        with torch.no_grad():
            return model.generate(torch.tensor([PROMPT]), generation_config=config, pad_token_id=0)[0].tolist()

    def ours(seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        outputs = generate_batch(model, [PROMPT, PROMPT], config, CACHE, progress_bar=False)
        return [output.generated_tokens for output in outputs.values()]

    assert theirs(1) == theirs(1) != theirs(2)
    first = ours(1)
    assert first[0] != first[1]  # each request its own seed
    assert ours(1) == first != ours(2)
    state = torch.get_rng_state()  # a greedy call draws nothing, as transformers' greedy generate
    generate_batch(model, [PROMPT], GenerationConfig(do_sample=False, max_new_tokens=2), CACHE, progress_bar=False)
    assert torch.equal(state, torch.get_rng_state())
    seeded = ContinuousBatchingConfig(num_blocks=64, block_size=4, seed=7)  # the config's seed still decides
    torch.manual_seed(1)
    assert generate_batch(model, [PROMPT], config, seeded, progress_bar=False)["req_0"].generated_tokens == (
        generate_batch(model, [PROMPT], config, seeded, progress_bar=False)["req_0"].generated_tokens
    )
