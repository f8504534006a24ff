"""Weights changed in place from outside the engine (a trainer's step through `.data`, then
`Engine.weights_changed()`, or while a manager is paused): a prompt cached before the change is computed again, not
served from its cached prefix, whose keys and values the old weights made. The reference is the changed model's own
teacher-forced forward; the prefix cache is on (its hits are what went stale)."""

from __future__ import annotations

import torch

from conftest import make_prompts, run_to_completion
from rollout import ContinuousBatchingConfig, SamplingParams, init_continuous_batching
from rollout.benchmarks.throughput.fidelity import teacher_forced_logprobs
from rollout.engine.engine import Engine
from rollout.presets import tiny_model

GREEDY = SamplingParams(do_sample=False, max_new_tokens=8, stop_token_ids=())
PROMPT = make_prompts(1, 40, 40, seed=4)[0]  # several whole blocks: a second run of it is a prefix hit


def _change_keys(model: torch.nn.Module, seed: int) -> None:
    """New key and value projections in every layer, through `.data` (torch's version counter does not see it)."""
    other = tiny_model(seed)
    for layer, new in zip(model.model.layers, other.model.layers):
        layer.self_attn.k_proj.weight.data.copy_(new.self_attn.k_proj.weight)
        layer.self_attn.v_proj.weight.data.copy_(new.self_attn.v_proj.weight)


def _gap(model: torch.nn.Module, tokens: list[int], logprobs: list[float]) -> float:
    return (torch.tensor(logprobs) - teacher_forced_logprobs(model, PROMPT, tokens)).abs().max().item()


def test_an_engine_told_the_weights_changed_computes_a_cached_prompt_again():
    model = tiny_model(0)
    engine = Engine(model, ContinuousBatchingConfig(num_blocks=64, block_size=8))
    engine.add_request("a", PROMPT, GREEDY)
    run_to_completion(engine)
    _change_keys(model, seed=5)
    engine.weights_changed()
    engine.add_request("b", PROMPT, GREEDY)
    hits = engine.block_manager.num_prefix_tokens_hit
    output = run_to_completion(engine)["b"]
    assert engine.block_manager.num_prefix_tokens_hit == hits  # no block of the old weights' was reused
    assert _gap(model, output.generated_tokens, output.logprobs) < 1e-4
    engine.close()


def test_a_manager_paused_while_the_weights_change_computes_a_cached_prompt_again():
    model = tiny_model(0)
    with init_continuous_batching(model, continuous_batching_config=ContinuousBatchingConfig(num_blocks=64)) as manager:
        manager.get_result(manager.add_request(PROMPT, sampling=GREEDY), timeout=60)
        with manager.pause():
            _change_keys(model, seed=6)
        second = manager.get_result(manager.add_request(PROMPT, sampling=GREEDY), timeout=60)
    assert _gap(model, second.generated_tokens, second.logprobs) < 1e-4
