"""Speculative decoding for samples that return MoE routes (`return_routes`): a drafted step records a route row for
every position it computes, rejected drafts' too; those positions are computed again before anything reads them, so
every token's routes are those of the forward that sampled it. With the same seeds the drafted engine gives the same
tokens, log-probs and routes as the plain one (bit for bit under `batch_invariant=True`), and the routes equal the
router choices transformers reports for a teacher-forced forward, also over preemption and prefix-cache hits."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from test_routes import check_against_reference

from conftest import make_engine, make_prompts, reference_copy, run_to_completion, tiny_model
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.config import SamplingParams
from rollout.engine.speculative import drafter as drafter_module

ROUTED = SamplingParams(do_sample=True, temperature=1.0, stop_token_ids=(), return_routes=True)


@pytest.fixture(scope="module")
def repetitive_moe():
    """A tiny Qwen3-MoE with a low-entropy head: siblings agree, so drafts get accepted."""
    model = tiny_model("qwen3_moe", seed=3)
    scale_to_entropy(model, make_prompts(4, 20, 40, seed=1), 0.3)
    return model


@pytest.fixture
def every_draft(monkeypatch):
    """Draft whatever matches, however often drafts were rejected (every verification path runs)."""
    monkeypatch.setattr(drafter_module, "MIN_ACCEPTANCE", 0.0)


def run(model, speculative: str | None, overlap: bool) -> tuple[dict, object]:
    """Two rounds of three n=3 groups in a cache small enough to preempt; the second round's prompts start with the
    first round's (prefix-cache hits whose routes come from the route cache)."""
    engine = make_engine(
        copy.deepcopy(model),
        num_blocks=40,
        max_batch_tokens=32,
        batch_invariant=True,
        speculative=speculative,
        speculative_disable_by_batch_size=32,
        overlap_scheduling=overlap,
    )
    prompts = make_prompts(3, 9, 14, seed=21)
    outputs = {}
    for round_index in range(2):
        for index, prompt in enumerate(prompts):
            sampling = ROUTED.merged(seed=10 * round_index + index)
            engine.add_request(f"r{round_index}g{index}", prompt, sampling, n=3, max_new_tokens=24)
        outputs.update(run_to_completion(engine))
    return outputs, engine


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_drafted_samples_return_the_routes_of_the_forward_that_sampled_each_token(repetitive_moe, every_draft, overlap):
    plain, plain_engine = run(repetitive_moe, None, overlap)
    drafted, engine = run(repetitive_moe, "suffix", overlap)
    drafter = engine.scheduler.drafter
    assert drafter.accepted_tokens >= 20, "drafts should be accepted, or nothing was compared"
    assert drafter.accepted_tokens < drafter.proposed_tokens, "some drafts should be rejected too"
    assert engine.scheduler.num_preemptions > 0, "the cache should be small enough to preempt"
    assert engine.block_manager.num_prefix_tokens_hit > 0
    reference = reference_copy(repetitive_moe)
    assert drafted.keys() == plain.keys()
    for key, expected in plain.items():
        got = drafted[key]
        assert got.generated_tokens == expected.generated_tokens, key
        assert got.logprobs == expected.logprobs, key
        assert np.array_equal(got.routes, expected.routes), key
        assert np.array_equal(got.prompt_routes, expected.prompt_routes), key
        check_against_reference(reference, got)
    plain_engine.close()
    engine.close()


def known_route_blocks(engine, prompt: list[int], generated: list[int]) -> int:
    """How many leading full blocks of prompt + generated the prefix cache holds with their routes known."""
    from rollout.engine.requests.request import Request

    manager = engine.block_manager
    tokens = list(prompt) + list(generated)
    probe = Request("probe", "probe", 0, tokens, len(prompt), ROUTED, 8, frozenset(), seed=0, arrival=0)
    known = 0
    for block_hash in manager._token_block_hashes(probe, (len(probe.token_ids) - 1) // manager.block_size):
        block = manager.cached_blocks.get(block_hash)
        if block is None or not manager.routed.knows(block_hash, block):
            break
        known += 1
    return known


def test_a_sample_ending_inside_a_verification_leaves_its_blocks_routes_to_the_route_cache(repetitive_moe, every_draft):
    """Blocks a verification's accepted drafts fill are offered to the route cache before the sample's end frees
    them, as a plain decode's are: a continuation of the completion (the next turn) then reuses them whole. The second
    round draws its drafts from the first's completions (the prefix cache is emptied between the rounds, so only the
    second round's own blocks can be known); with these lengths one sample ends inside a verification."""
    prompts = make_prompts(4, 9, 14, seed=21)
    known = {}
    for speculative in (None, "suffix"):
        engine = make_engine(
            copy.deepcopy(repetitive_moe),
            num_blocks=200,
            batch_invariant=True,
            speculative=speculative,
            speculative_disable_by_batch_size=32,
        )
        for round_index in range(2):
            for index, prompt in enumerate(prompts):
                sampling = ROUTED.merged(seed=index + 10 * round_index)
                engine.add_request(f"r{round_index}g{index}", prompt, sampling, max_new_tokens=17)
            outputs = run_to_completion(engine)
            if round_index == 0:
                engine.block_manager.reset_prefix_cache()
        known[speculative] = {
            key: known_route_blocks(engine, prompts[int(key[-1])], output.generated_tokens)
            for key, output in outputs.items()
        }
        if speculative:
            assert engine.scheduler.drafter.accepted_tokens >= 10, "drafts should be accepted"
        engine.close()
    assert known["suffix"] == known[None]
    assert all(count >= 5 for count in known[None].values())
