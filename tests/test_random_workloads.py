"""Randomised workloads (fixed seeds): random cache sizes, budgets, policies, swap space, prefix sharing, groups,
mid-run arrivals and cancellations. Every completion must equal transformers' greedy `generate`, every group must
yield exactly n outputs, and no block may leak."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import MODEL_CONFIGS, make_engine, reference_copy, tiny_model
from rollout.config import SamplingParams

GREEDY = SamplingParams(do_sample=False, stop_token_ids=())
KINDS = list(MODEL_CONFIGS)


def _reference(model, prompt: list[int], length: int) -> list[int]:
    ones = torch.ones(1, len(prompt), dtype=torch.long)
    out = model.generate(
        torch.tensor([prompt]), attention_mask=ones, do_sample=False, min_new_tokens=length, max_new_tokens=length
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_matches_generate(seed):
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    model = tiny_model(kind, seed=seed)
    reference = reference_copy(model)
    prefixes = [[rng.randrange(200) for _ in range(rng.randint(4, 24))] for _ in range(2)]
    groups = []
    for index in range(rng.randint(3, 7)):
        prompt = rng.choice(prefixes) + [rng.randrange(200) for _ in range(rng.randint(0, 10))]
        groups.append((f"g{index}", prompt, rng.randint(1, 3), rng.randint(1, 12)))
    block_size = rng.randint(1, 8)
    largest = max(-(-(len(p) + k - 1) // block_size) for _, p, _, k in groups)
    engine = make_engine(
        model,
        block_size=block_size,
        num_blocks=largest * rng.randint(1, 3),
        max_batch_tokens=rng.randint(1, 48),
        max_num_seqs=rng.randint(1, 12),
        scheduler_type=rng.choice(["fifo", "prefill_first"]),
        allow_block_sharing=rng.random() < 0.7,
        cpu_offload_space=rng.choice([0, 0.01]),
    )
    pending, cancelled, finals = list(groups), set(), {}
    while pending or engine.has_unfinished():
        if pending and rng.random() < 0.5:
            group_id, prompt, n, length = pending.pop(0)
            engine.add_request(group_id, prompt, GREEDY, n=n, max_new_tokens=length)
        if engine.has_unfinished() and rng.random() < 0.03:
            victim = rng.choice([g for g, *_ in groups if g not in cancelled])
            cancelled.add(victim)
            outputs = engine.cancel(victim)
        else:
            outputs = engine.step()
        for output in outputs:
            assert output.request_id not in finals, "a sample finished twice"
            finals[output.request_id] = output
    for group_id, prompt, n, length in groups:
        samples = [finals.pop(group_id if n == 1 else f"{group_id}#{i}") for i in range(n)]
        expected = _reference(reference, prompt, length)
        for sample in samples:
            if sample.finish_reason == "abort":
                assert group_id in cancelled and expected[: len(sample.generated_tokens)] == sample.generated_tokens
            else:
                assert (sample.finish_reason, sample.generated_tokens) == ("length", expected), (kind, group_id)
    assert not finals, f"outputs for unknown samples: {sorted(finals)}"
    engine.block_manager.check_all_free()
