"""`rollout-bench throughput`: generated tokens/s of this engine vs transformers' `generate_batch` (continuous
batching) and `generate` (one left-padded static batch), one after another in one process, same model and prompts.

Every system decodes greedily with EOS ignored and must produce each request's own `max_new_tokens`; tokens/s counts
exactly those tokens (a static batch computes up to the longest, but only the requested tokens count).
"""

from __future__ import annotations

import copy
import gc
import logging
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from rollout.config import ContinuousBatchingConfig, SamplingParams
from rollout.engine.generate import generate_batch
from rollout.service.presets import TINY_MODEL_CONFIG


@dataclass(frozen=True)
class Workload:
    """A throughput workload (docs/architecture.md, Benchmark workloads)."""

    name: str
    device: str
    dtype: torch.dtype
    num_prompts: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    model_config: dict
    engine_config: dict
    # Systems run when none are named: a static-batch `generate` of 256 long sequences is left out on the GPU.
    default_systems: tuple[str, ...] = ("rollout", "transformers_generate_batch", "transformers_generate")


WORKLOADS = {
    "cpu-small": Workload(
        name="cpu-small",
        device="cpu",
        dtype=torch.float32,
        num_prompts=64,
        prompt_len=(16, 256),
        output_len=(16, 256),
        model_config=TINY_MODEL_CONFIG,
        engine_config=dict(block_size=16, num_blocks=2304, max_batch_tokens=2048, max_num_seqs=64),
    ),
    "nano": Workload(
        name="nano",
        device="cuda",
        dtype=torch.bfloat16,
        num_prompts=256,
        prompt_len=(100, 1024),
        output_len=(100, 1024),
        # The Qwen3-0.6B architecture with random weights.
        model_config=dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            tie_word_embeddings=True,
        ),
        engine_config=dict(block_size=16, max_batch_tokens=8192, max_num_seqs=256),
        default_systems=("rollout", "rollout_sequential", "transformers_generate_batch"),
    ),
}


_STARTED = time.monotonic()


def stage(message: str) -> None:
    """One progress line on stderr, with the seconds since the benchmark started: a run killed at its time limit
    still shows in its log how far it got."""
    print(f"[{time.monotonic() - _STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)


def make_workload(workload: Workload, seed: int = 0) -> tuple[torch.nn.Module, list[list[int]], list[int]]:
    """The random model (seeded) and the prompts with their own max_new_tokens."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**workload.model_config), dtype=workload.dtype)
    model = model.to(workload.device).eval()
    rng = random.Random(seed)
    vocab = workload.model_config["vocab_size"]
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(*workload.prompt_len))] for _ in range(workload.num_prompts)
    ]
    max_new = [rng.randint(*workload.output_len) for _ in range(workload.num_prompts)]
    return model, prompts, max_new


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_rollout(model, prompts, max_new, workload: Workload, **overrides: Any) -> tuple[float, list[list[int]]]:
    """This engine: every prompt with its own max_new_tokens, greedy, EOS ignored.

    Args:
        overrides: ContinuousBatchingConfig fields set on top of the workload's.
    """
    config = ContinuousBatchingConfig(**{**workload.engine_config, **overrides})
    sampling = [SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=m) for m in max_new]
    _sync(workload.device)
    start = time.perf_counter()
    outputs = generate_batch(
        model, prompts, continuous_batching_config=config, progress_bar=False, sampling=sampling, warmup=False
    )
    _sync(workload.device)
    elapsed = time.perf_counter() - start
    return elapsed, [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]


def run_transformers_generate_batch(model, prompts, max_new, workload: Workload) -> tuple[float, list[list[int]]]:
    """transformers' continuous batching manager, each request with its own max_new_tokens, with our cache size,
    page size, token budget and batch width."""
    from transformers import ContinuousBatchingConfig as TransformersConfig
    from transformers import GenerationConfig

    from rollout.transformers_configs import page_size_field

    generation_config = GenerationConfig(do_sample=False, max_new_tokens=max(max_new), eos_token_id=-1)
    # The same cache and batch shape as ours (page = block), so neither side wins on settings alone.
    engine = workload.engine_config
    settings = dict(
        max_batch_tokens=engine["max_batch_tokens"],
        max_requests_per_batch=engine["max_num_seqs"],
        num_blocks=engine.get("num_blocks"),
    )
    settings[page_size_field()] = engine["block_size"]
    manager = model.init_continuous_batching(
        generation_config=generation_config, continuous_batching_config=TransformersConfig(**settings)
    )
    _sync(workload.device)
    start = time.perf_counter()
    manager.start()
    for index, (prompt, count) in enumerate(zip(prompts, max_new)):
        manager.add_request(prompt, request_id=f"req_{index}", max_new_tokens=count)
    results = {}
    deadline = time.monotonic() + 600
    while len(results) < len(prompts):
        # Short polls: a generation thread that died (an error inside transformers) is reported at once rather
        # than waited on; a live one that stops producing is given 600 s.
        output = manager.get_result(timeout=1)
        if output is None:
            if not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped (see its log above) before finishing")
            if time.monotonic() > deadline:
                raise RuntimeError("transformers generate_batch produced no result within 600 s")
            continue
        deadline = time.monotonic() + 600
        if output.is_finished():
            results[output.request_id] = output.generated_tokens
    manager.stop(block=True)
    _sync(workload.device)
    elapsed = time.perf_counter() - start
    return elapsed, [results[f"req_{i}"] for i in range(len(prompts))]


def run_transformers_generate(model, prompts, max_new, workload: Workload) -> tuple[float, list[list[int]]]:
    """transformers' `generate` on one left-padded static batch up to the longest max_new_tokens."""
    width = max(len(p) for p in prompts)
    pad = 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=workload.device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=workload.device)
    longest = max(max_new)
    _sync(workload.device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,
        )
    _sync(workload.device)
    elapsed = time.perf_counter() - start
    return elapsed, [output[i, width : width + m].tolist() for i, m in enumerate(max_new)]


def run_rollout_sequential(model, prompts, max_new, workload: Workload) -> tuple[float, list[list[int]]]:
    """This engine with overlapped scheduling off: each step is scheduled after the last one's tokens reached the
    host (what overlap gains is the difference)."""
    return run_rollout(model, prompts, max_new, workload, overlap_scheduling=False)


SYSTEMS = {
    "rollout": run_rollout,
    "rollout_sequential": run_rollout_sequential,
    "transformers_generate_batch": run_transformers_generate_batch,
    "transformers_generate": run_transformers_generate,
}


# The untimed warm-up run of each system: the first prompts, few tokens (kernels compiled, allocator warm).
WARMUP_PROMPTS, WARMUP_TOKENS = 8, 16


def run(
    workload_name: str,
    systems: list[str] | None = None,
    seed: int = 0,
    repeats: int = 1,
    details: bool = False,
    warmup: bool = True,
    num_prompts: int | None = None,
) -> dict:
    """Run the workload on each system and return the JSON-able summary (also printed as a table).

    Args:
        workload_name: a key of WORKLOADS.
        systems: which systems to run (default: the workload's `default_systems`).
        seed: model and prompt seed.
        repeats: runs per system; the median time is reported.
        details: add `rollout.benchmarks.details` figures (decode roofline fraction, peak memory, logprob fidelity).
        warmup: run each system once, untimed, on a few short prompts first (Triton's JIT compilation and other
            first-call costs then stay out of the timed runs, whichever system runs first).
        num_prompts: run this many of the workload's requests (the first ones; default: all).
    """
    workload = WORKLOADS[workload_name]
    if workload.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"workload {workload_name!r} needs a CUDA device")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    stage(f"building the {workload_name} model and prompts")
    base_model, prompts, max_new = make_workload(workload, seed)
    prompts, max_new = prompts[:num_prompts], max_new[:num_prompts]
    useful_tokens = sum(max_new)
    results: dict[str, dict] = {}
    reference_tokens = None
    for name in systems or workload.default_systems:
        if warmup:
            stage(f"{name}: warm-up")
            count = min(WARMUP_PROMPTS, len(prompts))
            short = [min(m, WARMUP_TOKENS) for m in max_new[:count]]
            SYSTEMS[name](copy.deepcopy(base_model), prompts[:count], short, workload)
            gc.collect()
        times = []
        for repeat in range(repeats):
            stage(f"{name}: run {repeat + 1} of {repeats}, {len(prompts)} prompts, {useful_tokens} tokens")
            model = copy.deepcopy(base_model)
            elapsed, tokens = SYSTEMS[name](model, prompts, max_new, workload)
            stage(f"{name}: {elapsed:.2f} s")
            assert [len(t) for t in tokens] == max_new, f"{name} did not produce the requested lengths"
            times.append(elapsed)
            del model
            gc.collect()
        elapsed = statistics.median(times)
        if reference_tokens is None:
            reference_tokens = tokens
        same = sum(a == b for a, b in zip(tokens, reference_tokens))
        results[name] = {
            "seconds": round(elapsed, 3),
            "tokens_per_s": round(useful_tokens / elapsed, 1),
            "identical_to_first": same,
            "runs_s": [round(t, 3) for t in times],
        }
    summary = {
        "benchmark": "throughput",
        "workload": workload_name,
        "generated_tokens": useful_tokens,
        "num_prompts": len(prompts),
        "repeats": repeats,
        "warmup": warmup,
        "torch_threads": torch.get_num_threads(),
        "results": results,
    }
    if "rollout" in results:
        for name, result in results.items():
            if name != "rollout":
                summary[f"speedup_vs_{name}"] = round(results["rollout"]["tokens_per_s"] / result["tokens_per_s"], 2)
    if details:
        from rollout.benchmarks.details import run_details

        stage("details: instrumented runs")
        summary["details"] = run_details(base_model, prompts, max_new, workload.engine_config)
    _print_table(summary)
    return summary


def _print_table(summary: dict) -> None:
    print(
        f"workload {summary['workload']}: {summary['num_prompts']} prompts, {summary['generated_tokens']} generated "
        f"tokens, median of {summary['repeats']} run(s), {summary['torch_threads']} torch threads"
    )
    print(f"{'system':<30}{'seconds':>10}{'tokens/s':>12}{'vs rollout':>12}{'same tokens':>13}")
    rollout = summary["results"].get("rollout")
    for name, result in summary["results"].items():
        ratio = "" if rollout is None else f"{rollout['tokens_per_s'] / result['tokens_per_s']:.2f}x"
        same = f"{result['identical_to_first']}/{summary['num_prompts']}"
        print(f"{name:<30}{result['seconds']:>10.2f}{result['tokens_per_s']:>12.1f}{ratio:>12}{same:>13}")
    details = summary.get("details")
    if details:
        print(
            f"decode roofline fraction {details['decode_roofline_fraction']:.3f} (device copy bandwidth "
            f"{details['device_bandwidth_gb_per_s']} GB/s, median decode step {details['median_decode_step_ms']} ms), "
            f"peak memory {details['peak_memory_gib']} GiB"
        )
        for key in ("default", "fp32_logits"):
            row = details[key]
            print(
                f"logprob |rollout - teacher-forced| ({key}): mean {row['logprob_abs_diff_mean']:.2e}, "
                f"max {row['logprob_abs_diff_max']:.2e}"
            )
