"""`rollout-bench grpo`: the GRPO workload (docs/concepts/architecture.md, Benchmark workloads). 32 prompts of 128-512
tokens, each sampled n=8 times (temperature 1, EOS ignored) with its own 32-256 new tokens. Reports generated
tokens/s, and prompt tokens actually computed against what computing every sample's prompt separately would cost (a
group prefills its prompt once and forks).

Compared with transformers' continuous batching given the same 256 requests (8 copies of each prompt) with our cache,
page size, token budget and batch width. With `--speculative suffix`, rollout also runs the round with speculative
decoding (in a process of its own): the same tokens, and the round's time to its last sample side by side. On CPU (`--device cpu`, the default without CUDA) the model is the cpu-small
shape; on CUDA it is the nano model (the Qwen3-0.6B architecture, bf16).
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from rollout.benchmarks.harness.choices import GRPO_NUM_PROMPTS as NUM_PROMPTS
from rollout.benchmarks.harness.isolated import run_system
from rollout.benchmarks.harness.progress import stage
from rollout.benchmarks.harness.workloads import WORKLOADS, Workload, make_workload
from rollout.benchmarks.throughput.systems import WARMUP_PROMPTS, WARMUP_TOKENS, run_transformers_generate_batch, sync
from rollout.config import ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import Engine

GROUP_SIZE = 8
PROMPT_LEN, OUTPUT_LEN = (128, 512), (32, 256)
SYSTEMS = ("rollout", "rollout_speculative", "transformers_generate_batch")
SYSTEM_TIMEOUT_S = 300.0


def _requests(workload: Workload, seed: int, num_prompts: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    vocab = workload.model_config["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*PROMPT_LEN))] for _ in range(num_prompts)]
    return prompts, [rng.randint(*OUTPUT_LEN) for _ in range(num_prompts)]


def _run_groups(engine: Engine, prompts: list[list[int]], max_new: list[int], seed: int, device: str) -> float:
    """Every prompt as a group of GROUP_SIZE samples; seconds until all finished."""
    for index, (prompt, count) in enumerate(zip(prompts, max_new)):
        sampling = SamplingParams(do_sample=True, temperature=1.0, stop_token_ids=(), seed=seed + index)
        engine.add_request(f"g{index}", prompt, sampling, n=GROUP_SIZE, max_new_tokens=count)
    sync(device)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync(device)
    return time.perf_counter() - start


def measure_system(system: str, device: str, seed: int = 0, num_prompts: int = NUM_PROMPTS) -> dict[str, Any]:
    """Warm `system` up, then time the groups (`isolated.py` runs this in a process of its own).

    Args:
        system: "rollout" or "transformers_generate_batch".
        device: "cpu" or "cuda".
        seed: model and prompt seed.
        num_prompts: groups to run.
    """
    workload = WORKLOADS["nano" if device == "cuda" else "cpu-small"]
    model, _, _ = make_workload(workload, seed)
    prompts, max_new = _requests(workload, seed, num_prompts)
    generated = GROUP_SIZE * sum(max_new)
    if system == "transformers_generate_batch":
        warm = min(WARMUP_PROMPTS, len(prompts))
        stage("transformers_generate_batch: warm-up")
        run_transformers_generate_batch(model, prompts[:warm], [WARMUP_TOKENS] * warm, workload)
        stage(f"transformers_generate_batch: {num_prompts} groups of {GROUP_SIZE} (greedy, the same requests)")
        rows = [p for p in prompts for _ in range(GROUP_SIZE)]
        seconds, _ = run_transformers_generate_batch(
            model, rows, [m for m in max_new for _ in range(GROUP_SIZE)], workload
        )
        return {"seconds": round(seconds, 3), "tokens_per_s": round(generated / seconds, 1)}
    if system not in ("rollout", "rollout_speculative"):
        raise ValueError(f"unknown system {system!r}; one of {list(SYSTEMS)}")
    speculative = "suffix" if system == "rollout_speculative" else None
    engine = Engine(model, ContinuousBatchingConfig(**workload.cache_config(), speculative=speculative))
    try:
        stage("rollout: warm-up")
        engine.warmup()
        _run_groups(engine, prompts[:WARMUP_PROMPTS], [WARMUP_TOKENS] * min(WARMUP_PROMPTS, len(prompts)), seed, device)
        engine.block_manager.reset_prefix_cache()  # the timed groups prefill their prompts themselves
        before = engine.stats()
        computed_before = engine.counters.computed_tokens
        stage(f"rollout: {num_prompts} groups of {GROUP_SIZE}")
        seconds = _run_groups(engine, prompts, max_new, seed, device)
        computed = engine.counters.computed_tokens - computed_before
        stats = {key: value - before[key] for key, value in engine.stats().items() if key.endswith("_tokens")}
        if stats["generated_tokens"] != generated:
            raise RuntimeError("rollout did not generate the requested lengths")
    finally:
        engine.close()
    rejected = stats["draft_tokens"] - stats["accepted_draft_tokens"]
    return {
        "seconds": round(seconds, 3),
        "tokens_per_s": round(generated / seconds, 1),
        "generated_tokens": generated,
        "draft_tokens": stats["draft_tokens"],
        "accepted_draft_tokens": stats["accepted_draft_tokens"],
        # Every sample feeds back all its tokens but the last (an accepted draft is one of them); the rest of what
        # was computed, rejected drafts aside, is prompt.
        "prompt_tokens_computed": computed - rejected - GROUP_SIZE * sum(m - 1 for m in max_new),
        "prompt_tokens_without_sharing": GROUP_SIZE * sum(len(p) for p in prompts),
    }


def run(
    device: str | None = None,
    seed: int = 0,
    transformers: bool = True,
    num_prompts: int = NUM_PROMPTS,
    speculative: str | None = None,
) -> dict:
    """Run the workload, each system in its own process, and return the JSON-able summary (also printed).

    Args:
        device: "cpu" or "cuda" (default: cuda when available).
        seed: model and prompt seed.
        transformers: also run transformers' generate_batch on the same requests.
        num_prompts: groups to run (fewer than the workload's 32: a quick run).
        speculative: also run rollout with this speculative decoding ("suffix"; None: not).
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    workload = WORKLOADS["nano" if device == "cuda" else "cpu-small"]
    options = dict(device=device, seed=seed, num_prompts=num_prompts)
    rollout = run_system("grpo", "rollout", options, SYSTEM_TIMEOUT_S)
    summary: dict[str, Any] = {
        "benchmark": "grpo",
        "device": device,
        "model": workload.name,
        "prompts": num_prompts,
        "group_size": GROUP_SIZE,
        "kv_budget_bytes": workload.kv_budget_bytes(),
        "generated_tokens": rollout.get("generated_tokens"),
        "rollout": rollout,
        "prompt_tokens_computed": rollout.get("prompt_tokens_computed"),
        "prompt_tokens_without_sharing": rollout.get("prompt_tokens_without_sharing"),
    }
    print(f"grpo workload on {device} ({workload.name} model): {num_prompts} prompts x n={GROUP_SIZE}")
    print(f"rollout: {_figure(rollout)}")
    if speculative is not None:
        drafted = summary["rollout_speculative"] = run_system("grpo", "rollout_speculative", options, SYSTEM_TIMEOUT_S)
        print(f"rollout, speculative={speculative}: {_figure(drafted)}")
        if rollout["status"] == drafted["status"] == "ok":
            summary["speculative_last_sample_ratio"] = round(drafted["seconds"] / rollout["seconds"], 3)
            print(
                f"the round's last sample: {drafted['seconds']:.2f} s against {rollout['seconds']:.2f} s "
                f"({summary['speculative_last_sample_ratio']:.3f}x); {drafted['accepted_draft_tokens']} of "
                f"{drafted['draft_tokens']} draft tokens accepted"
            )
    if transformers:
        theirs = summary["transformers_generate_batch"] = run_system(
            "grpo", "transformers_generate_batch", options, SYSTEM_TIMEOUT_S
        )
        print(f"transformers generate_batch (greedy, the same requests): {_figure(theirs)}")
        if rollout.get("tokens_per_s") and theirs.get("tokens_per_s"):
            summary["speedup_vs_transformers_generate_batch"] = round(
                rollout["tokens_per_s"] / theirs["tokens_per_s"], 2
            )
            print(f"rollout {summary['speedup_vs_transformers_generate_batch']:.2f}x transformers' generate_batch")
    if rollout["status"] == "ok":
        computed, unshared = rollout["prompt_tokens_computed"], rollout["prompt_tokens_without_sharing"]
        print(
            f"prompt tokens computed: {computed} (without sharing: {unshared}, {unshared / max(computed, 1):.1f}x more)"
        )
    return summary


def _figure(result: dict[str, Any]) -> str:
    if result["status"] != "ok":
        return f"{result['status'].upper()} after {result['seconds']:.0f} s (see its output above)"
    return f"{result['tokens_per_s']:.1f} tokens/s"
