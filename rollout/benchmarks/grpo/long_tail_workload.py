"""The long-tail workload of `rollout-bench long-tail` (long_tail.py): its model (`build_model`), each prompt's samples
and their own lengths (`make_workload`), and how they reach the engine (`submit`): every sample its own request, its
length either told to the scheduler (`max_new_tokens`) or made by a stop token pushed up at its length."""

from __future__ import annotations

import math
import random

import torch
from transformers import Qwen3Config

from rollout.benchmarks.grpo.long_tail_flags import Shape
from rollout.benchmarks.harness import workloads
from rollout.benchmarks.harness.stub_model import VOCAB as STUB_VOCAB
from rollout.benchmarks.harness.stub_model import stub_model
from rollout.config import SamplingParams
from rollout.engine.engine import Engine
from rollout.presets.models import TINY_MODEL_CONFIG, tiny_model
from rollout.validation import MAX_LOGIT_BIAS

NANO_CONFIG = workloads.QWEN3_0_6B  # the nano model's architecture (a CPU test swaps in a smaller one)


def vocab_size(model: str) -> int:
    """The vocabulary of the run's model ("stub", "tiny" or "nano"): its last token is the stop token."""
    return {"stub": STUB_VOCAB, "tiny": TINY_MODEL_CONFIG["vocab_size"], "nano": NANO_CONFIG["vocab_size"]}[model]


def build_model(model: str, seed: int, device: str, max_len: int) -> torch.nn.Module:
    """The run's model: "stub" (ready logits: its forward is replaced once the engine holds it), "tiny" (the built-in
    tiny model, fp32) or "nano" (the Qwen3-0.6B architecture in bf16, random weights, made on `device`), seeded.

    Args:
        model: "stub", "tiny" or "nano".
        seed: the weights' seed.
        device: where the model lives.
        max_len: the longest prompt + length (checked against the model's context).
    Raises:
        ValueError: a sequence would outgrow the model's context.
    """
    if model == "stub":
        return stub_model(max_len)
    if model == "tiny":
        net = tiny_model(seed).to(device)
    else:
        torch.manual_seed(seed)
        net = workloads.build_model(Qwen3Config(**NANO_CONFIG), device, torch.bfloat16).eval()
    context = net.config.max_position_embeddings
    if max_len > context:
        raise ValueError(f"prompt + length reach {max_len} tokens; the {model} model's context is {context}")
    return net


def make_workload(shape: Shape, seed: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Random prompts and each sample's length: (prompts, lengths[prompt][sample])."""
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(shape.num_prompts):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(*shape.prompt_tokens))])
        draws = (rng.lognormvariate(math.log(shape.median_tokens), shape.sigma) for _ in range(shape.n))
        lengths.append([min(shape.max_tokens, max(1, round(draw))) for draw in draws])
    return prompts, lengths


def submit(
    engine: Engine,
    prompts: list[list[int]],
    lengths: list[list[int]],
    max_tokens: int,
    stop_token: int,
    seed: int,
    known_lengths: bool,
) -> dict[str, int]:
    """Add every sample as its own request; returns each request id's length."""
    expected: dict[str, int] = {}
    for g, (prompt, group) in enumerate(zip(prompts, lengths)):
        for j, length in enumerate(group):
            seed_j = seed * 100_003 + len(expected)
            if known_lengths:
                sampling = SamplingParams(do_sample=True, temperature=1.0, stop_token_ids=(), seed=seed_j)
            else:
                sampling = SamplingParams(
                    do_sample=True,
                    temperature=1.0,
                    min_new_tokens=length - 1,
                    stop_token_ids=(stop_token,),
                    logit_bias={stop_token: MAX_LOGIT_BIAS},
                    seed=seed_j,
                )
            expected[f"p{g}s{j}"] = length
            engine.add_request(f"p{g}s{j}", prompt, sampling, max_new_tokens=length if known_lengths else max_tokens)
    return expected
