"""`fp32_logits` keeps an fp32 copy of the output head, refreshed in place whenever the weights may have changed: it
must give a trainer's fp32-head logprobs (TRL's cast_lm_head_to_fp32) for whatever weights the model holds at that
step."""

from __future__ import annotations

import copy

import torch

from conftest import make_prompts, run_to_completion
from rollout import ContinuousBatchingConfig, SamplingParams, generate_batch, init_continuous_batching
from rollout.benchmarks.throughput.fidelity import teacher_forced_logprobs
from rollout.engine.engine import Engine
from rollout.presets import tiny_model

STALE = 0.02  # mean |delta| beyond which the logprobs came from other weights (measured: 0.1 and more here)
GREEDY = SamplingParams(do_sample=False, max_new_tokens=12, stop_token_ids=())
PROMPT = make_prompts(1, 24, 24, seed=3)[0]


def _config() -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(num_blocks=64, fp32_logits=True)


def _delta(model: torch.nn.Module, tokens: list[int], logprobs: list[float]) -> float:
    """Mean |engine - teacher-forced| with the trainer's fp32 head over the same tokens (bf16 activations leave about
    1e-3; a stale head's logprobs are off by far more, see STALE)."""
    reference = teacher_forced_logprobs(model, PROMPT, tokens, fp32_head=True)
    return (torch.tensor(logprobs) - reference).abs().mean().item()


def _generate(engine: Engine) -> tuple[list[int], list[float]]:
    engine.add_request("a", PROMPT, GREEDY)
    output = run_to_completion(engine)["a"]
    return output.generated_tokens, output.logprobs


def test_the_fp32_copy_gives_the_trainers_fp32_head_logprobs():
    model = tiny_model(0, dtype=torch.bfloat16)
    engine = Engine(copy.deepcopy(model), _config())
    assert engine.runner.fp32_head.weight.dtype == torch.float32
    tokens, logprobs = _generate(engine)
    engine.close()
    assert engine.runner.fp32_head.weight is None  # the copy goes with the engine
    assert _delta(model, tokens, logprobs) < 2e-3
    assert model.lm_head.weight.dtype == torch.bfloat16  # the model's own weights are left as they are


def test_a_weight_update_refreshes_the_copy_in_place():
    model = tiny_model(0, dtype=torch.bfloat16)
    engine = Engine(model, _config())
    copy_address = engine.runner.fp32_head.weight.data_ptr()
    old_model = copy.deepcopy(model)
    new_head = tiny_model(1, dtype=torch.bfloat16).lm_head.weight.detach().clone()
    engine.update_weights({"lm_head.weight": new_head}, partial=True)
    tokens, logprobs = _generate(engine)
    assert _delta(old_model, tokens, logprobs) > STALE  # what a stale copy would have matched
    assert engine.runner.fp32_head.weight.data_ptr() == copy_address  # graphs captured against it stay valid
    assert torch.equal(engine.runner.fp32_head.weight, new_head.float())
    assert _delta(model, tokens, logprobs) < 2e-3  # the new head's logprobs, not the old one's
    engine.close()


def test_weights_changed_between_calls_or_during_a_pause_are_seen():
    """A kept engine's next generate_batch call, and a manager paused while the caller changes the weights through
    `.data` (which torch's version counter does not see), both sample with the new head."""
    model = tiny_model(0, dtype=torch.bfloat16)
    kept = dict(continuous_batching_config=_config(), persistent_manager=True, progress_bar=False, sampling=GREEDY)
    generate_batch(model, [PROMPT], **kept)
    model.lm_head.weight.data.copy_(tiny_model(2, dtype=torch.bfloat16).lm_head.weight)
    output = generate_batch(model, [PROMPT], **kept)["req_0"]
    assert _delta(model, output.generated_tokens, output.logprobs) < 2e-3
    from rollout.engine.generate import release_cached_engine

    release_cached_engine(model)

    with init_continuous_batching(model, continuous_batching_config=_config()) as manager:
        first = manager.get_result(manager.add_request(PROMPT, sampling=GREEDY), timeout=60)
        with manager.pause():
            model.lm_head.weight.data.copy_(tiny_model(3, dtype=torch.bfloat16).lm_head.weight)
        second = manager.get_result(manager.add_request(PROMPT, sampling=GREEDY), timeout=60)
    assert _delta(model, second.generated_tokens, second.logprobs) < 2e-3
    assert _delta(model, first.generated_tokens, first.logprobs) > STALE  # the first ran on the earlier head


def test_an_engine_built_under_inference_mode_refreshes_outside_it():
    """A trainer may build the engine inside torch.inference_mode(); the copy is then an inference tensor, and
    updating it later (a weight update, a pause) must still work outside inference mode."""
    model = tiny_model(0, dtype=torch.bfloat16)
    with torch.inference_mode():
        engine = Engine(model, _config())
    new_head = tiny_model(1, dtype=torch.bfloat16).lm_head.weight.detach().clone()
    engine.update_weights({"lm_head.weight": new_head}, version=5, partial=True)
    tokens, logprobs = _generate(engine)
    assert engine.policy_version == 5 and _delta(model, tokens, logprobs) < 2e-3
    engine.close()
