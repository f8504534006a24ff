"""`generate_batch` interrupted by Ctrl-C: a `GenerationInterrupted` (a KeyboardInterrupt) whose `outputs` are the
samples finished by then, each equal to transformers' greedy `generate`, and the engine closed."""

from __future__ import annotations

import pytest
import torch

from rollout import SamplingParams, generate_batch
from rollout.engine.engine import Engine
from rollout.engine.generate import GenerationInterrupted, SamplesFailedWarning, cached_engine
from rollout.presets import tiny_model


def test_ctrl_c_returns_the_finished_samples_with_the_interrupt(monkeypatch):
    model = tiny_model(seed=3).eval()
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=2)[0, 3:].tolist()
    step, closed, finished = Engine.step, [], []
    monkeypatch.setattr(Engine, "close", lambda self, close=Engine.close: (closed.append(self), close(self))[1])

    def interrupted_step(self):  # Ctrl-C at the step after the first prompt's last
        if finished:
            raise KeyboardInterrupt
        outputs = step(self)
        finished.extend(output for output in outputs if output.request_id == "req_0")
        return outputs

    monkeypatch.setattr(Engine, "step", interrupted_step)
    sampling = [SamplingParams(temperature=0, max_new_tokens=2), SamplingParams(temperature=0, max_new_tokens=40)]
    with pytest.raises(KeyboardInterrupt) as caught:
        generate_batch(model, prompts, sampling=sampling, progress_bar=False, persistent_manager=True)
    assert isinstance(caught.value, GenerationInterrupted)
    assert list(caught.value.outputs) == ["req_0"]  # the second prompt was still generating
    assert str(caught.value) == "generate_batch interrupted: 1 of 2 samples had finished (in its .outputs)"
    assert caught.value.outputs["req_0"].generated_tokens == reference
    assert closed and cached_engine(model) is None


def test_samples_that_failed_are_said_in_a_warning():
    """A sample whose prompt and length can never fit the KV cache ends with finish_reason "error" and its reason;
    a caller reading only the tokens got empty samples and no word of why. The others are generated as usual."""
    from rollout import ContinuousBatchingConfig

    model = tiny_model(seed=3).eval()
    config = ContinuousBatchingConfig(num_blocks=8, block_size=4)
    sampling = [SamplingParams(temperature=0, max_new_tokens=2), SamplingParams(temperature=0, max_new_tokens=200)]
    with pytest.warns(
        SamplesFailedWarning, match=r"generate_batch: 1 of 2 samples failed .*; the first, req_1: request needs"
    ):
        results = generate_batch(
            model, [[5, 6, 7], [8, 9]], sampling=sampling, continuous_batching_config=config, progress_bar=False
        )
    assert results["req_1"].finish_reason == "error" and results["req_1"].generated_tokens == []
    assert len(results["req_0"].generated_tokens) == 2
