"""The engine's host time per decode step: what the CPU spends on a step besides the model's forward and the
sampling kernels (scheduling, batch preparation, sampling-state preparation, output handling). On a GPU this work
must hide behind the device's decode step; for a small model that step takes a few milliseconds.

Measured with `running` sequences all decoding, sampled as GRPO samples them (temperature, top-p, top-k, a seed
each): the model's forward is replaced by a stub that returns ready logits, and the vocabulary is small (64
tokens), so the sampling kernels cost next to nothing and what is left of a step is the engine's own host work.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from rollout.config import ContinuousBatchingConfig, SamplingParams
from rollout.engine.engine import Engine

VOCAB = 64
STEPS = 100  # timed decode steps per measurement


def _stub_model(device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=8192,
    )
    return AutoModelForCausalLM.from_config(config).to(device).eval()


def host_ms_per_step(running: int, device: str = "cpu", steps: int = STEPS) -> float:
    """Median host milliseconds per decode step with `running` sequences decoding.

    Args:
        running: sequences decoding at once (one batch).
        device: where the engine runs ("cpu" or "cuda").
        steps: decode steps timed.
    """
    target = torch.device(device)
    engine = Engine(
        _stub_model(target),
        ContinuousBatchingConfig(
            block_size=16,
            num_blocks=running * 8 + 8,
            max_num_seqs=running,
            max_batch_tokens=max(running * 16, 2048),
            use_cuda_graph=False,
        ),
    )
    logits = torch.randn(running, VOCAB, device=target)

    def forward(input_ids: torch.Tensor, positions: Any, metadata: Any, keep: torch.Tensor) -> torch.Tensor:
        return logits[: keep.numel()]  # ready logits: no model compute

    engine.runner._forward = forward  # noqa: SLF001 - the measurement leaves out exactly the model's forward
    engine.runner._decode_forward = forward  # noqa: SLF001
    for index in range(running):
        sampling = SamplingParams(
            do_sample=True, temperature=0.9, top_p=0.95, top_k=50, seed=index, stop_token_ids=(), max_new_tokens=4096
        )
        engine.add_request(f"s{index}", [(index + k) % VOCAB for k in range(16)], sampling)
    while engine.scheduler.waiting or any(r.num_computed_tokens < 16 for r in engine.scheduler.running):
        engine.step()  # prefill: every prompt in the cache, every sequence decoding from here on
    times = []
    for _ in range(steps + 5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.close()
    return statistics.median(times[5:]) * 1000


def run_host_time(device: str = "cpu", sizes: tuple[int, ...] = (64, 256)) -> dict[str, float]:
    """`host_ms_per_step` at each number of running sequences, rounded to µs."""
    return {str(size): round(host_ms_per_step(size, device), 3) for size in sizes}
