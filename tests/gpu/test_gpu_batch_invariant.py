"""GPU test (`pytest -m gpu tests/gpu`) of `batch_invariant=True` on CUDA: the engine's log-probs (its linear layers
on the fixed-tile Triton matmul, its attention through `rollout.invariant.attend_invariant`) equal the trainer's
forward under `trainer_bridge.batch_invariant` in TRL's padded layout bit for bit, in bf16, on a model scaled to
realistic entropy, through chunked prefill and shared prompts. Skipped without CUDA (CI has none)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_gpu import small_qwen3

from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.benchmarks.throughput.fidelity import padded_batch_logprobs, scale_to_entropy
from rollout.engine.engine import Engine
from trainer_bridge import batch_invariant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_engine_logprobs_equal_the_trainers_invariant_forward():
    model = small_qwen3(torch.bfloat16)  # built in bf16: its rotary frequencies stay fp32, as a worker's
    scale_to_entropy(model, [list(range(3, 40)), list(range(100, 160))])
    trainer = copy.deepcopy(model)
    engine = Engine(model, ContinuousBatchingConfig(batch_invariant=True, num_blocks=512, max_batch_tokens=48))
    for index, prompt in enumerate([[(7 * i + j) % 4096 for j in range(5 + 9 * i)] for i in range(6)]):
        engine.add_request(f"g{index}", prompt, SamplingParams(temperature=1.0, seed=index), n=3, max_new_tokens=40)
    samples = []
    while engine.has_unfinished():
        samples += [(o.prompt_ids, o.generated_tokens, o.logprobs) for o in engine.step() if o.is_finished]
    engine.close()
    assert len(samples) == 18
    prompts, completions = [list(p) for p, _, _ in samples], [list(c) for _, c, _ in samples]
    with batch_invariant(trainer):  # the trainer's forward: TRL's layout, batches of 5
        reference = list(padded_batch_logprobs(trainer, prompts, completions, batch_size=5))
    gaps = [float((torch.tensor(lp) - ref).abs().max()) for (_, _, lp), ref in zip(samples, reference)]
    assert max(gaps) == 0.0, f"largest |delta| {max(gaps):.3e}, {sum(g > 0 for g in gaps)} of {len(gaps)} samples"
