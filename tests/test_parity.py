"""Greedy parity with transformers' own `generate`, for every model family, under settings that force chunked
prefill, preemption (recompute and CPU swap) and prefix sharing."""

from __future__ import annotations

import pytest
import torch

from conftest import MODEL_CONFIGS, make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.config import SamplingParams

GREEDY = SamplingParams(do_sample=False, stop_token_ids=())
MAX_NEW = 24


def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    output = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
    )
    return output[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", list(MODEL_CONFIGS))
def test_greedy_matches_generate_with_chunking_and_preemption(kind):
    """Small token budget (chunked prefill, mixed batches) and a cache too small for all requests (preemption):
    every completion still equals transformers' generate token for token, and no block leaks."""
    model = tiny_model(kind)
    reference = reference_copy(model)
    prompts = make_prompts(6, 5, 60, seed=1)
    engine = make_engine(model, num_blocks=40, block_size=4, max_batch_tokens=32)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, GREEDY, max_new_tokens=MAX_NEW)
    outputs = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0, "the cache should be small enough to force preemption"
    for index, prompt in enumerate(prompts):
        assert outputs[str(index)].generated_tokens == reference_greedy(reference, prompt, MAX_NEW), index
        assert outputs[str(index)].finish_reason == "length"
    engine.block_manager.check_all_free()


@pytest.mark.parametrize("kind", ["qwen3", "mistral_sliding"])
def test_greedy_matches_generate_with_cpu_swap(kind):
    """Preempted requests swapped to CPU blocks and back resume exactly where they were."""
    model = tiny_model(kind)
    reference = reference_copy(model)
    prompts = make_prompts(6, 5, 60, seed=2)
    engine = make_engine(model, num_blocks=40, block_size=4, max_batch_tokens=64, cpu_offload_space=0.01)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, GREEDY, max_new_tokens=MAX_NEW)
    outputs = run_to_completion(engine)
    assert engine.scheduler.num_swaps > 0
    for index, prompt in enumerate(prompts):
        assert outputs[str(index)].generated_tokens == reference_greedy(reference, prompt, MAX_NEW), index
    engine.block_manager.check_all_free()


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_prefix_sharing_and_policies_keep_parity(policy):
    """Prompts sharing a long prefix reuse cached blocks (fewer tokens computed) and still match generate."""
    model = tiny_model("llama")
    reference = reference_copy(model)
    prefix = make_prompts(1, 40, 40, seed=3)[0]
    prompts = [prefix + tail for tail in make_prompts(4, 1, 9, seed=4)]
    engine = make_engine(model, num_blocks=128, block_size=4, max_batch_tokens=48, scheduler_type=policy)
    engine.add_request("first", prompts[0], GREEDY, max_new_tokens=4)
    run_to_completion(engine)  # its prefix blocks stay cached after it finishes
    computed_before = engine.counters.computed_tokens
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, GREEDY, max_new_tokens=MAX_NEW)
    outputs = run_to_completion(engine)
    # Without sharing: every prompt token plus every generated token but the last is computed.
    unshared = sum(len(p) + MAX_NEW - 1 for p in prompts)
    assert engine.counters.computed_tokens - computed_before <= unshared - len(prompts) * (len(prefix) // 4 - 1) * 4
    for index, prompt in enumerate(prompts):
        assert outputs[str(index)].generated_tokens == reference_greedy(reference, prompt, MAX_NEW), index
    assert engine.block_manager.cached_blocks, "full prompt blocks should be offered for reuse"
    engine.block_manager.check_all_free()


def test_group_shares_prompt_blocks_and_greedy_samples_agree():
    """A greedy group of n=4 prefills once: every sample equals generate, and the prompt's full blocks are held
    once (ref count 4) rather than copied."""
    model = tiny_model("qwen3")
    reference = reference_copy(model)
    prompt = make_prompts(1, 30, 30, seed=5)[0]
    engine = make_engine(model, num_blocks=64, block_size=4)
    ids = engine.add_request("group", prompt, GREEDY, n=4, max_new_tokens=MAX_NEW)
    engine.step()  # prefill + first tokens: forks happen here
    full_prompt_blocks = len(prompt) // 4
    samples = engine.scheduler.running
    assert len(samples) == 4
    shared = samples[0].block_ids[:full_prompt_blocks]
    assert all(s.block_ids[:full_prompt_blocks] == shared for s in samples)
    assert all(engine.block_manager.ref_counts[b] == 4 for b in shared)
    outputs = run_to_completion(engine)
    expected = reference_greedy(reference, prompt, MAX_NEW)
    assert [outputs[i].generated_tokens for i in ids] == [expected] * 4
    engine.block_manager.check_all_free()
