"""Extra figures of `rollout-bench throughput --details`, from one more (instrumented) run of this engine:

- decode roofline fraction: per pure-decode step, the bytes it must read (every weight once, plus the KV of every
  sequence's context) over the step's measured forward time, divided by the device's memory bandwidth, measured in
  the same run with a device-to-device copy;
- peak memory (CUDA: `max_memory_allocated`);
- logprob fidelity: |rollout logprob - teacher-forced logprob| of every generated token, where the teacher-forced
  one comes from the same transformers model (its own attention, same dtype) run over prompt + completion; with and
  without `fp32_logits` (the reference then projects in fp32 too);
- the engine's host time per decode step at 64 and 256 running sequences, and its phases (host_time.py).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

from rollout.benchmarks.host_time import run_host_time
from rollout.benchmarks.throughput import stage
from rollout.config import ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import Engine
from rollout.engine.model_runner import fp32_projection


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


def instrumented_run(
    model: torch.nn.Module, prompts: list[list[int]], max_new: list[int], engine_config: dict, fp32_logits: bool
) -> tuple[dict[str, Any], list[list[float]], list[list[int]]]:
    """Run the engine once with a timing probe around each forward.

    Returns:
        (decode step figures, logprobs per prompt, generated tokens per prompt).
    """
    device = next(model.parameters()).device
    engine = Engine(model, ContinuousBatchingConfig(**engine_config, fp32_logits=fp32_logits))
    engine.warmup()  # decode CUDA graphs captured before any step is timed
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


@torch.inference_mode()
def teacher_forced_logprobs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], fp32_head: bool = False
) -> torch.Tensor:
    """Log-probs of `tokens` after `prompt` from one ordinary forward of the model (fp32 log_softmax of its
    logits, in the model's own dtype up to there; with `fp32_head`, the output projection in fp32, as TRL's
    cast_lm_head_to_fp32 does)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(fp32_projection) if fp32_head else None
    try:
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    finally:
        if hook is not None:
            hook.remove()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens, device=device).unsqueeze(1))[:, 0].cpu()


def run_details(base_model: torch.nn.Module, prompts: list[list[int]], max_new: list[int], engine_config: dict) -> dict:
    """The figures of this module's docstring, as a JSON-able dict."""
    device = next(base_model.parameters()).device
    bandwidth = device_bandwidth(device)
    details: dict[str, Any] = {"device_bandwidth_gb_per_s": round(bandwidth / 1e9, 1)}
    for fp32_logits in (False, True):
        model = copy.deepcopy(base_model)
        stage(f"details: instrumented run, fp32_logits={fp32_logits}")
        figures, logprobs, tokens = instrumented_run(model, prompts, max_new, engine_config, fp32_logits)
        deltas = torch.cat(
            [
                (torch.tensor(lp) - teacher_forced_logprobs(model, prompt, out, fp32_logits)).abs()
                for prompt, out, lp in zip(prompts, tokens, logprobs)
            ]
        )
        key = "fp32_logits" if fp32_logits else "default"
        details[key] = {
            "logprob_abs_diff_mean": float(deltas.mean()),
            "logprob_abs_diff_max": float(deltas.max()),
        }
        if not fp32_logits:
            details["decode_roofline_fraction"] = round(figures["decode_bytes_per_s"] / bandwidth, 3)
            details["median_decode_step_ms"] = round(figures["median_decode_step_ms"], 2)
            details["decode_steps"] = figures["decode_steps"]
            details["peak_memory_gib"] = figures["peak_memory_gib"]
        del model
    stage("details: host time per step")
    host_time = run_host_time(device.type)
    details["host_ms_per_step"] = {size: figures["host"] for size, figures in host_time.items()}
    details["host_time_ms"] = host_time  # the whole step, the sampling kernels taken out of it, and its phases
    return details
