"""The throughput workloads (docs/concepts/architecture.md, Benchmark workloads): the model shape, the prompts, each request's
own output length, and the KV cache every system gets, as one budget in bytes.

The table is plain data, free of torch (dtypes by name), so that `rollout-bench`'s parser offers its names without
loading torch; torch, transformers and the engine load in the methods that build or measure something."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout.presets.catalog import TINY_MODEL_CONFIG

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from rollout.engine.kv.kv_cache import KVCacheShape

GIB = 1 << 30

# The Qwen3-0.6B architecture (random weights): the nano workload's model, and the GPU shape of grpo and grpo-step.
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class Workload:
    """A throughput workload."""

    name: str
    device: str
    dtype_name: str  # the parameters' and the KV cache's torch dtype, by name: `dtype` is the torch.dtype
    num_prompts: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    model_config: dict
    engine_config: dict  # block_size, max_batch_tokens, max_num_seqs (num_blocks comes from kv_budget_gib)
    # The KV cache of every system, in GiB of K and V (the same bytes for each: transformers gets as many pages of
    # the same size as we get blocks).
    kv_budget_gib: float
    # Systems run when none are named: a static-batch `generate` of 256 long sequences is left out on the GPU.
    default_systems: tuple[str, ...] = ("rollout", "transformers_generate_batch", "transformers_generate")
    system_timeout_s: float = 600.0  # each system's own limit, warm-up and every repeat included

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' and the KV cache's dtype."""
        import torch

        return getattr(torch, self.dtype_name)

    def cache_shape(self) -> KVCacheShape:
        """Layers, KV heads and head dim of the workload's model."""
        from transformers import Qwen3Config

        from rollout.engine.kv.kv_cache import KVCacheShape

        return KVCacheShape.from_model_config(Qwen3Config(**self.model_config))

    def num_blocks(self) -> int:
        """KV blocks of `engine_config["block_size"]` tokens that `kv_budget_gib` holds."""
        per_block = self.cache_shape().bytes_per_block(self.engine_config["block_size"], self.dtype)
        return int(self.kv_budget_gib * GIB) // per_block

    def kv_budget_bytes(self) -> int:
        """Bytes of the cache every system gets (whole blocks of the budget)."""
        return self.num_blocks() * self.cache_shape().bytes_per_block(self.engine_config["block_size"], self.dtype)

    def cache_config(self) -> dict:
        """`engine_config` with the budget's `num_blocks`: rollout's ContinuousBatchingConfig fields."""
        return {**self.engine_config, "num_blocks": self.num_blocks()}


CPU_SMALL = Workload(
    name="cpu-small",
    device="cpu",
    dtype_name="float32",
    num_prompts=64,
    prompt_len=(16, 256),
    output_len=(16, 256),
    model_config=TINY_MODEL_CONFIG,
    engine_config=dict(block_size=16, max_batch_tokens=2048, max_num_seqs=64),
    kv_budget_gib=0.140625,  # 2304 blocks of 16 tokens (64 KiB each): every request fits at once
)

WORKLOADS = {
    "cpu-small": CPU_SMALL,
    # The cpu-small model in bf16: bf16 logprob fidelity against the trainer's floor, measured on a CPU (--details).
    # The same 2304 blocks (32 KiB each in bf16).
    "cpu-bf16": dataclasses.replace(
        CPU_SMALL, name="cpu-bf16", dtype_name="bfloat16", kv_budget_gib=0.0703125, default_systems=("rollout",)
    ),
    "nano": Workload(
        name="nano",
        device="cuda",
        dtype_name="bfloat16",
        num_prompts=256,
        prompt_len=(100, 1024),
        output_len=(100, 1024),
        model_config=QWEN3_0_6B,
        engine_config=dict(block_size=16, max_batch_tokens=8192, max_num_seqs=256),
        # 40 GiB: about 366k tokens at 112 KiB per token, more than the 256 sequences' mean total length needs at
        # once, and room on an 80 GB card for the model, transformers' prefill logits and the graphs.
        kv_budget_gib=40.0,
        default_systems=("rollout", "rollout_sequential", "transformers_generate_batch"),
        system_timeout_s=420.0,
    ),
}


def build_model(config: PretrainedConfig, device: str | torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random model from `config`, initialised on `device` itself: a GPU fills the weights in well under a second,
    where a CPU takes about 17 s for the Qwen3-0.6B shape (one thread draws the random numbers, whatever the dtype),
    and a model built on the CPU would then be copied over. In `dtype` from the start: a cast afterwards would also
    round the rotary embedding's fp32 buffers. Seeded by the caller (`torch.manual_seed`): the same weights in every
    process on the same kind of device.

    Args:
        config: a transformers model config.
        device: where the model lives.
        dtype: its parameters' dtype.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def make_workload(workload: Workload, seed: int = 0) -> tuple[torch.nn.Module, list[list[int]], list[int]]:
    """The random model (seeded, the same in every process) and the prompts with their own max_new_tokens.

    Args:
        workload: what to build.
        seed: model and prompt seed.
    """
    import torch
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    model = build_model(Qwen3Config(**workload.model_config), workload.device, workload.dtype).eval()
    rng = random.Random(seed)
    vocab = workload.model_config["vocab_size"]
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(*workload.prompt_len))] for _ in range(workload.num_prompts)
    ]
    max_new = [rng.randint(*workload.output_len) for _ in range(workload.num_prompts)]
    return model, prompts, max_new
