"""GPU test (`pytest -m gpu tests/gpu`) of `batch_invariant=True` on CUDA: the engine's log-probs (its linear layers
on the fixed-tile Triton matmul, its attention through `rollout.invariant.attend_invariant`) equal the trainer's
forward under `trainer_bridge.batch_invariant` in TRL's padded layout bit for bit, in bf16, on a model scaled to
realistic entropy, through chunked prefill and shared prompts. Skipped without CUDA (CI has none)."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout import ContinuousBatchingConfig, SamplingParams
from rollout.benchmarks.throughput.fidelity import scale_to_entropy
from rollout.engine.engine import Engine
from trainer_bridge import batch_invariant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def padded_logprobs(model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Each completion's log-probs from one forward in TRL's layout (prompts left-, completions right-padded)."""
    prompt_width, completion_width = max(len(p) for p, _ in pairs), max(len(c) for _, c in pairs)
    rows, masks = [], []
    for prompt, completion in pairs:
        left, right = prompt_width - len(prompt), completion_width - len(completion)
        rows.append([0] * left + prompt + completion + [0] * right)
        masks.append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
    ids, mask = torch.tensor(rows, device="cuda"), torch.tensor(masks, device="cuda")
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    return [
        torch.log_softmax(logits[row, prompt_width - 1 : prompt_width - 1 + len(c)], -1)
        .gather(1, torch.tensor(c, device="cuda")[:, None])[:, 0]
        .cpu()
        for row, (_, c) in enumerate(pairs)
    ]


def test_bf16_engine_logprobs_equal_the_trainers_invariant_forward():
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    scale_to_entropy(model, [list(range(3, 40)), list(range(100, 160))])
    trainer = copy.deepcopy(model)
    engine = Engine(model, ContinuousBatchingConfig(batch_invariant=True, num_blocks=512, max_batch_tokens=48))
    prompts = [[(7 * i + j) % 4096 for j in range(5 + 9 * i)] for i in range(6)]
    for index, prompt in enumerate(prompts):
        engine.add_request(f"g{index}", prompt, SamplingParams(temperature=1.0, seed=index), n=3, max_new_tokens=40)
    samples = []
    while engine.has_unfinished():
        samples += [(o.prompt_ids, o.generated_tokens, o.logprobs) for o in engine.step() if o.is_finished]
    engine.close()
    assert len(samples) == 18
    gaps = []
    with torch.no_grad(), batch_invariant(trainer):
        for first in range(0, len(samples), 5):
            chunk = samples[first : first + 5]
            reference = padded_logprobs(trainer, [(list(p), list(c)) for p, c, _ in chunk])
            gaps += [float((torch.tensor(lp) - ref).abs().max()) for (_, _, lp), ref in zip(chunk, reference)]
    assert max(gaps) == 0.0, f"largest |delta| {max(gaps):.3e}, {sum(g > 0 for g in gaps)} of {len(gaps)} samples"
