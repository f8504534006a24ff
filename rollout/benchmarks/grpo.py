"""`rollout-bench grpo`: the GRPO workload (docs/architecture.md, Benchmark workloads). 32 prompts of 128-512
tokens, each sampled n=8 times (temperature 1, EOS ignored) with its own 32-256 new tokens. Reports generated
tokens/s, and prompt tokens actually computed against what computing every sample's prompt separately would cost (a
group prefills its prompt once and forks).

Compared with transformers' continuous batching given the same 256 requests (8 copies of each prompt) with our cache,
page size, token budget and batch width. On CPU (`--device cpu`, the default without CUDA) the model is the cpu-small
shape; on CUDA it is the nano model (the Qwen3-0.6B architecture, bf16).
"""

from __future__ import annotations

import copy
import random
import time

import torch

from rollout.benchmarks.throughput import (
    WARMUP_PROMPTS,
    WARMUP_TOKENS,
    WORKLOADS,
    _sync,
    make_workload,
    run_rollout,
    run_transformers_generate_batch,
    stage,
)
from rollout.config import ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import Engine

NUM_PROMPTS, GROUP_SIZE = 32, 8
PROMPT_LEN, OUTPUT_LEN = (128, 512), (32, 256)


def run(device: str | None = None, seed: int = 0, transformers: bool = True, num_prompts: int = NUM_PROMPTS) -> dict:
    """Run the workload and return the JSON-able summary (also printed).

    Args:
        device: "cpu" or "cuda" (default: cuda when available).
        seed: model and prompt seed.
        transformers: also run transformers' generate_batch on the same requests.
        num_prompts: groups to run (fewer than the workload's 32: a quick run).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    workload = WORKLOADS["nano" if device == "cuda" else "cpu-small"]
    base_model, _, _ = make_workload(workload, seed)
    rng = random.Random(seed)
    vocab = workload.model_config["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*PROMPT_LEN))] for _ in range(num_prompts)]
    max_new = [rng.randint(*OUTPUT_LEN) for _ in range(num_prompts)]

    # Untimed warm-ups of both systems on a few short requests: compilation and first-call costs stay out.
    warm_prompts, warm_lengths = prompts[:WARMUP_PROMPTS], [WARMUP_TOKENS] * min(WARMUP_PROMPTS, len(prompts))
    stage("rollout: warm-up")
    run_rollout(copy.deepcopy(base_model), warm_prompts, warm_lengths, workload)
    if transformers:
        stage("transformers_generate_batch: warm-up")
        run_transformers_generate_batch(copy.deepcopy(base_model), warm_prompts, warm_lengths, workload)
    stage(f"rollout: {num_prompts} groups of {GROUP_SIZE}")
    model = copy.deepcopy(base_model)
    engine = Engine(model, ContinuousBatchingConfig(**workload.engine_config))
    for index, (prompt, count) in enumerate(zip(prompts, max_new)):
        sampling = SamplingParams(do_sample=True, temperature=1.0, stop_token_ids=(), seed=seed + index)
        engine.add_request(f"g{index}", prompt, sampling, n=GROUP_SIZE, max_new_tokens=count)
    _sync(device)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    _sync(device)
    elapsed = time.perf_counter() - start
    engine.close()
    generated = GROUP_SIZE * sum(max_new)
    assert engine.num_generated_tokens == generated
    # Every sample feeds back all its tokens but the last; the rest of what was computed is prompt.
    prompt_computed = engine.num_computed_tokens - GROUP_SIZE * sum(m - 1 for m in max_new)
    prompt_unshared = GROUP_SIZE * sum(len(p) for p in prompts)
    summary = {
        "benchmark": "grpo",
        "device": device,
        "model": workload.name,
        "prompts": num_prompts,
        "group_size": GROUP_SIZE,
        "generated_tokens": generated,
        "rollout": {"seconds": round(elapsed, 3), "tokens_per_s": round(generated / elapsed, 1)},
        "prompt_tokens_computed": prompt_computed,
        "prompt_tokens_without_sharing": prompt_unshared,
    }
    stage(f"rollout: {elapsed:.2f} s")
    del model
    if transformers:
        stage(f"transformers_generate_batch: {num_prompts} groups of {GROUP_SIZE}")
        rows = [p for p in prompts for _ in range(GROUP_SIZE)]
        lengths = [m for m in max_new for _ in range(GROUP_SIZE)]
        seconds, _ = run_transformers_generate_batch(copy.deepcopy(base_model), rows, lengths, workload)
        summary["transformers_generate_batch"] = {
            "seconds": round(seconds, 3),
            "tokens_per_s": round(generated / seconds, 1),
        }
        summary["speedup_vs_transformers_generate_batch"] = round(seconds / elapsed, 2)
    print(
        f"grpo workload on {device} ({workload.name} model): {num_prompts} prompts x n={GROUP_SIZE}, "
        f"{generated} generated tokens"
    )
    print(f"rollout: {summary['rollout']['tokens_per_s']:.1f} tokens/s")
    if transformers:
        print(
            f"transformers generate_batch (greedy, the same 256 requests): "
            f"{summary['transformers_generate_batch']['tokens_per_s']:.1f} tokens/s "
            f"(rollout {summary['speedup_vs_transformers_generate_batch']:.2f}x)"
        )
    print(
        f"prompt tokens computed: {prompt_computed} (without sharing: {prompt_unshared}, "
        f"{prompt_unshared / max(prompt_computed, 1):.1f}x more)"
    )
    return summary
