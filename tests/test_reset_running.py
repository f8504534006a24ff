"""vLLM's `reset_prefix_cache(reset_running_requests=True)`: after weights changed in place with mode "keep", the
running samples compute their KV again from their tokens under the new weights, so that they go on as a "recompute"
update would have had them. Reference: transformers' greedy `generate` of the new weights on prompt + tokens so far;
without the reset, the samples go on over the old weights' KV (what transformers gives for that mixed cache)."""

from __future__ import annotations

from test_weight_updates import GREEDY, greedy, mixed_kv_greedy, running, step_n, two_policies

from conftest import make_engine, make_prompts, run_to_completion


def test_reset_running_requests_has_the_samples_recompute_their_kv_under_the_new_weights():
    model, reference_a, reference_b, state_b = two_policies()
    max_new, k = 16, 5
    prompts = make_prompts(3, 10, 30, seed=12)
    engine = make_engine(model)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, GREEDY, max_new_tokens=max_new)
    step_n(engine, k)
    sampled = {rid: request.output_ids for rid, request in running(engine).items()}
    assert len(sampled) == 3 and all(len(tokens) == k for tokens in sampled.values())
    engine.update_weights(state_b, mode="keep")  # the samples would go on over the old weights' KV

    computed_before = engine.counters.computed_tokens
    assert engine.reset_prefix_cache(reset_running_requests=True) == 3
    outputs = run_to_completion(engine)
    # Every context token is computed again (prompt + k), then one per further sampled token but the last.
    assert engine.counters.computed_tokens - computed_before == sum(len(p) + max_new - 1 for p in prompts)
    for index, prompt in enumerate(prompts):
        first = sampled[f"r{index}"]
        continuation = greedy(reference_b, prompt + first, max_new - k)
        # The reference tells the reset from keeping the old KV, or this test could not fail.
        assert continuation != mixed_kv_greedy(reference_a, state_b, prompt + first[:-1], first[-1:], max_new - k)
        output = outputs[f"r{index}"]
        assert output.generated_tokens == first + continuation, index
        assert output.kv_version_min == 1


def test_a_reset_without_the_flag_leaves_running_samples_on_their_kv():
    model = two_policies()[0]
    engine = make_engine(model)
    engine.add_request("r", make_prompts(1, 10, 10, seed=3)[0], GREEDY, max_new_tokens=8)
    step_n(engine, 3)
    computed_before = engine.counters.computed_tokens
    assert engine.reset_prefix_cache() == 0
    run_to_completion(engine)
    assert engine.counters.computed_tokens - computed_before == 8 - 3  # one token per step, nothing recomputed
