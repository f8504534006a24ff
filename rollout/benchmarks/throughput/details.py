"""Extra figures of `rollout-bench throughput --details`, from instrumented runs of this engine in a process of
their own (`isolated.py`), each engine warmed up first:

- decode roofline fraction: per pure-decode step, the bytes it must read (every weight once, plus the KV of every
  sequence's context) over the step's measured forward time, divided by the device's memory bandwidth, measured in
  the same run with a device-to-device copy;
- peak memory (CUDA: `max_memory_allocated`);
- logprob fidelity (fidelity.py): on the workload's model with its logits scaled to realistic entropy, |rollout
  logprob - teacher-forced logprob| of every generated token against the trainer's own floor (its padded-batch vs
  one-sequence forward), with and without `fp32_logits` (the reference then projects in fp32 too);
- the engine's host time per decode step at 64 and 256 running sequences, and its phases (host_time.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from rollout.benchmarks.harness.progress import stage
from rollout.benchmarks.harness.workloads import WORKLOADS, make_workload
from rollout.benchmarks.throughput.fidelity import fidelity_against_floor, scale_to_entropy
from rollout.benchmarks.throughput.host_time import run_host_time
from rollout.config import ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import Engine


def device_bandwidth(device: torch.device, megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), best of `repeats`."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        target.copy_(source)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm(engine: Engine, prompts: list[list[int]], max_new: list[int]) -> None:
    """Untimed: every prompt prefilled and the longest requests decoded to their end, so each kernel variant a run
    of these requests asks for (prefill tiles, split-K at long contexts) is compiled before anything is timed."""
    longest = sorted(range(len(prompts)), key=lambda index: -max_new[index])[:8]
    warm = [(prompts[i], 1) for i in range(len(prompts))] + [(prompts[i], max_new[i]) for i in longest]
    for index, (prompt, count) in enumerate(warm):
        engine.add_request(
            f"w{index}", prompt, SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=count)
        )
    while engine.has_unfinished():
        engine.step()
    engine.block_manager.reset_prefix_cache()  # the timed run computes its prompts again


def instrumented_run(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new: list[int],
    engine_config: dict,
    fp32_logits: bool,
    warm: bool = True,
) -> tuple[dict[str, Any], list[list[float]], list[list[int]]]:
    """Run the engine once with a timing probe around each forward.

    Args:
        warm: first compile what the run will ask for, untimed (see below); off when only the outputs matter.

    Returns:
        (decode step figures, logprobs per prompt, generated tokens per prompt).
    """
    device = next(model.parameters()).device
    engine = Engine(model, ContinuousBatchingConfig(**engine_config, fp32_logits=fp32_logits))
    engine.warmup()  # decode CUDA graphs captured before any step is timed
    if warm:
        _warm(engine, prompts, max_new)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shape = engine.kv_cache.shape
    kv_bytes_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * engine.kv_cache.kv.element_size()
    steps: list[tuple[float, int]] = []  # (seconds, bytes) of pure-decode forwards
    run = engine.runner.run

    def probe(batch, unresolved=None):
        decode = all(seq.num_tokens == 1 for seq in batch.sequences)
        _sync(device)
        start = time.perf_counter()
        logits = run(batch, unresolved)
        _sync(device)
        if decode:
            context = sum(seq.start + 1 for seq in batch.sequences)
            steps.append((time.perf_counter() - start, weight_bytes + context * kv_bytes_per_token))
        return logits

    engine.runner.run = probe
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for index, (prompt, count) in enumerate(zip(prompts, max_new)):
        engine.add_request(
            f"p{index}", prompt, SamplingParams(do_sample=False, stop_token_ids=(), max_new_tokens=count)
        )
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.is_finished:
                outputs[output.request_id] = output
    engine.close()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    seconds = sum(s for s, _ in steps)
    figures = {
        "decode_steps": len(steps),
        "decode_bytes_per_s": sum(b for _, b in steps) / seconds if seconds else 0.0,
        "median_decode_step_ms": statistics.median(s for s, _ in steps) * 1000 if steps else 0.0,
        "peak_memory_gib": None if peak is None else peak / 2**30,
    }
    order = [f"p{i}" for i in range(len(prompts))]
    return figures, [outputs[k].logprobs for k in order], [outputs[k].generated_tokens for k in order]


def measure_details(
    system: str, workload: str, seed: int = 0, num_prompts: int | None = None, fidelity_prompts: int = 32
) -> dict[str, Any]:
    """The figures of this module's docstring for the workload, as a JSON-able dict (`isolated.py` runs this in a
    process of its own).

    Args:
        system: "rollout" (the only one instrumented).
        workload: a key of WORKLOADS.
        seed: model and prompt seed.
        num_prompts: the workload's first requests only.
        fidelity_prompts: requests whose logprobs are compared (the reference forwards cost a model forward each).
    """
    if system != "rollout":
        raise ValueError(f"details instrument rollout only, not {system!r}")
    chosen = WORKLOADS[workload]
    model, prompts, max_new = make_workload(chosen, seed)
    prompts, max_new = prompts[:num_prompts], max_new[:num_prompts]
    device = next(model.parameters()).device
    bandwidth = device_bandwidth(device)
    details: dict[str, Any] = {"device_bandwidth_gb_per_s": round(bandwidth / 1e9, 1)}
    stage("details: instrumented run (decode roofline)")
    figures, _, _ = instrumented_run(model, prompts, max_new, chosen.cache_config(), False)
    details["decode_roofline_fraction"] = round(figures["decode_bytes_per_s"] / bandwidth, 3)
    details["median_decode_step_ms"] = round(figures["median_decode_step_ms"], 2)
    details["decode_steps"] = figures["decode_steps"]
    details["peak_memory_gib"] = None if figures["peak_memory_gib"] is None else round(figures["peak_memory_gib"], 2)
    count = min(fidelity_prompts, len(prompts))
    details["entropy_nats"] = round(scale_to_entropy(model, [p[:128] for p in prompts[:4]]), 3)
    for fp32_logits in (False, True):
        key = "fp32_logits" if fp32_logits else "default"
        stage(f"details: logprob fidelity, {key}, {count} requests at {details['entropy_nats']} nats")
        lengths = [min(m, 256) for m in max_new[:count]]
        # As many sequences as it runs: its engine captures the decode graphs of those batch sizes only.
        narrow = {**chosen.cache_config(), "max_num_seqs": count}
        _, logprobs, tokens = instrumented_run(model, prompts[:count], lengths, narrow, fp32_logits, warm=False)
        found = fidelity_against_floor(model, prompts[:count], tokens, logprobs, fp32_logits)
        details[key] = {
            "logprob_abs_diff_mean": found["rollout"]["mean"],
            "logprob_abs_diff_p99": found["rollout"]["p99"],
            "logprob_abs_diff_max": found["rollout"]["max"],
            "floor_abs_diff_mean": found["floor"]["mean"],
            "floor_abs_diff_p99": found["floor"]["p99"],
            "within_floor": found["rollout"]["mean"] <= found["floor"]["mean"]
            and found["rollout"]["p99"] <= found["floor"]["p99"],
        }
    stage("details: host time per step")
    host_time = run_host_time(device.type)
    details["host_ms_per_step"] = {size: figures["host"] for size, figures in host_time.items()}
    details["host_time_ms"] = host_time  # the whole step, the sampling kernels taken out of it, and its phases
    return details
