"""Validated configuration: the engine's `ContinuousBatchingConfig`, and the constants every layer shares (weight
update modes, the largest policy version, dtype names). Per-request `SamplingParams` live in sampling_params.py and
`FieldError` in validation.py; both are importable from here too.

Field names follow transformers' continuous batching where the concept is the same, so its users can carry their
settings over. Every field is checked in `__post_init__`; a bad value raises `FieldError` (a ValueError) naming the field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout.sampling_params import DEFAULT_MAX_NEW_TOKENS, LOGPROB_MODES, MIN_TEMPERATURE, SamplingParams
from rollout.validation import FieldError, _check, _is_int, _is_number

if TYPE_CHECKING:  # this module stays free of torch and transformers at import (the scheduler imports it)
    from transformers import CompileConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_MAX_NEW_TOKENS",
    "LOGPROB_MODES",
    "MAX_POLICY_VERSION",
    "MIN_TEMPERATURE",
    "MODEL_DTYPE_NAMES",
    "SCHEDULER_TYPES",
    "WEIGHT_UPDATE_MODES",
    "ContinuousBatchingConfig",
    "FieldError",
    "SamplingParams",
    "dtype_name",
]

SCHEDULER_TYPES = ("fifo", "prefill_first")
# Parameter dtypes by the names the command lines take ("auto": the checkpoint's own, fp32 for presets).
MODEL_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
# Policy versions travel as int64 (msgpack, tensors of versions): the largest a weight update may set.
MAX_POLICY_VERSION = 2**63 - 1
# What happens to in-flight samples when a weight update commits (Engine.update_weights documents each).
WEIGHT_UPDATE_MODES = ("keep", "recompute", "abort", "wait")


def dtype_name(dtype: Any) -> str:
    """A torch dtype as the wire names it: "bfloat16", "float32", ..."""
    return str(dtype).removeprefix("torch.")


ATTENTION_BACKENDS = ("auto", "torch", "triton")
SPECULATIVE_METHODS = (None, "suffix")
MAX_SPECULATIVE_TOKENS = 64  # draft tokens per sample and step, at most
# Most tokens (max_batch_tokens) and sequences (max_num_seqs) one step may compute: the engine sizes per-token
# buffers by them (adapter slots at the first adapter step, MoE routes at the first request asking, decode graphs), so a
# larger value failed there, after the model had loaded, with a traceback (an overflow, or an allocation of tens of
# GB), not an error naming the field.
MAX_STEP_ROWS = 1 << 24
# The settings that take effect only with `speculative` on.
SPECULATIVE_SETTINGS = (
    "num_speculative_tokens",
    "speculative_disable_by_batch_size",
    "speculative_index_tokens",
    "speculative_clear_on_weight_update",
)
logger = logging.getLogger("rollout.config")
_WARNED: set[str] = set()  # the speculative settings warned of, without speculative, in this process
# torch.compile modes that capture no CUDA graphs of their own ("reduce-overhead" and "max-autotune" do).
COMPILE_MODES_WITHOUT_GRAPHS = (None, "default", "max-autotune-no-cudagraphs")


@dataclass
class ContinuousBatchingConfig:
    """Engine settings: KV cache size, batch shape, scheduling policy, logprobs and queueing."""

    # Tokens per KV block. Smaller blocks share prefixes more finely; larger ones cut per-step metadata.
    block_size: int = 16
    # Number of KV blocks. None sizes the cache from max_memory_percent of free device memory.
    num_blocks: int | None = None
    # Most tokens (prefill chunks + decodes) computed in one engine step.
    max_batch_tokens: int = 2048
    # Most sequences in one engine step.
    max_num_seqs: int = 256
    # Fraction of free memory (after the model is loaded) given to the KV cache when num_blocks is None.
    # None: 0.9 on an accelerator, 0.05 of available RAM on CPU (CPU runs are for tests and examples).
    # (transformers' name; `rollout-worker --max-memory-percent` takes it as a percent: 90 for 0.9.)
    max_memory_percent: float | None = None
    # Reuse computed KV blocks across requests with the same prefix (and policy version).
    allow_block_sharing: bool = True
    # "fifo": running requests (decodes) first, then new prefills; "prefill_first": new prefills first.
    scheduler_type: str = "fifo"
    # Compute per-token log-probs for every request.
    return_logprobs: bool = True
    # GiB of CPU memory for swapping preempted requests' KV; 0 recomputes them instead.
    cpu_offload_space: float = 0.0
    # Most requests waiting to be scheduled (queued, not yet running); 0 means unbounded. A full queue is an error.
    max_queue_size: int = 0
    # Replay CUDA graphs for decode steps (one capture per bucketed batch size; `warmup()` captures them all ahead
    # of time). None: on CUDA whenever the Triton attention kernels serve it (with batch_invariant: its Triton
    # kernels, in fp32, bf16 or fp16); True: insist (an error without the kernels, or off CUDA); False: eager.
    use_cuda_graph: bool | None = None
    # Schedule step N+1 while step N runs on the device: the host's scheduling and input building hide behind the
    # GPU's forward, and step N's tokens reach the host once, after N+1 was queued. A sample that stops at step N
    # wastes one row of step N+1. None: on CUDA; False: schedule after each step's tokens are on the host.
    # Outputs are the same either way.
    overlap_scheduling: bool | None = None
    # torch.compile settings (transformers' CompileConfig) for the decode forward, None: no compilation. With CUDA
    # graphs on, the compiled forward is what gets captured, so its mode must not capture graphs itself.
    decode_compile_config: CompileConfig | None = None
    # Paged attention kernels: "auto" (Triton on CUDA when it is installed and block_size is a power of two >= 16,
    # else PyTorch), "torch", or "triton" (on CPU only inside Triton's interpreter, TRITON_INTERPRET=1: for tests).
    attention_backend: str = "auto"
    # Compute the final projection (lm_head) and the softmax in fp32 even for a bf16/fp16 model, or under a trainer's
    # mixed-precision autocast: logprobs closer to a trainer that does the same (TRL's cast_lm_head_to_fp32), for one
    # fp32 copy of a bf16/fp16 lm_head weight per step.
    fp32_logits: bool = False
    # Compute each token's logits bit for bit as `trainer_bridge.batch_invariant` makes the trainer's forward compute
    # them, whatever else is in the step and however the prompt was chunked or cached (rollout.invariant). The mode
    # brings its own attention and, on a GPU, its own Triton kernels (decode steps still replay CUDA graphs over
    # them); no compiled decode, and not the engine's Triton paged attention (`attention_backend="triton"`).
    batch_invariant: bool = False
    # Longest prompt + generation accepted; None uses the model's max_position_embeddings. Above it (RoPE scaling
    # included, as vLLM derives max_model_len) is refused.
    max_model_len: int | None = None
    # Seed of the seeds given to requests that bring none (None: fresh randomness), so a whole run can repeat.
    seed: int | None = None
    # LoRA adapters served side by side (unmerged, `Engine.load_adapter`): at most this many at once, each of rank
    # at most max_lora_rank. Their stacked weights are allocated when the first adapter arrives; the base model
    # alone costs nothing.
    max_loras: int = 4
    max_lora_rank: int = 16
    # Speculative decoding: "suffix" drafts each sample's next tokens from its prompt's other samples (its group's,
    # and earlier rounds') and verifies them in one forward, drawing every token as plain decoding would (the same
    # tokens for the same seed); None: off.
    speculative: str | None = None
    # Most draft tokens per sample and step (at most 64).
    num_speculative_tokens: int = 4
    # Draft only while a step decodes at most this many samples and nothing waits for admission (the long tail).
    speculative_disable_by_batch_size: int = 8
    # Tokens of finished samples kept to draft from, over all prompts (the least recently used prompts go first).
    speculative_index_tokens: int = 1 << 22
    # Forget the finished samples kept to draft from at a weight update (drafts are only proposals: by default
    # they outlive it); samples still running under a keep or recompute update join the new pools as they finish.
    speculative_clear_on_weight_update: bool = False

    def __post_init__(self) -> None:
        _check(
            _is_int(self.block_size) and self.block_size >= 1, "block_size", "must be an integer >= 1", self.block_size
        )
        if self.num_blocks is not None:
            _check(
                _is_int(self.num_blocks) and self.num_blocks >= 1,
                "num_blocks",
                "must be an integer >= 1",
                self.num_blocks,
            )
        _check(
            _is_int(self.max_batch_tokens) and 1 <= self.max_batch_tokens <= MAX_STEP_ROWS,
            "max_batch_tokens",
            f"must be an integer in [1, {MAX_STEP_ROWS}]",
            self.max_batch_tokens,
        )
        _check(
            _is_int(self.max_num_seqs) and 1 <= self.max_num_seqs <= MAX_STEP_ROWS,
            "max_num_seqs",
            f"must be an integer in [1, {MAX_STEP_ROWS}]",
            self.max_num_seqs,
        )
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, name, "must be an integer >= 1", value)
        if self.max_memory_percent is not None:
            _check(
                _is_number(self.max_memory_percent) and 0 < self.max_memory_percent <= 1,
                "max_memory_percent",
                "must be in (0, 1], a fraction: 0.9 for 90% (rollout-worker --max-memory-percent takes the percent)",
                self.max_memory_percent,
            )
        _check(
            isinstance(self.allow_block_sharing, bool),
            "allow_block_sharing",
            "must be a bool",
            self.allow_block_sharing,
        )
        _check(
            self.scheduler_type in SCHEDULER_TYPES,
            "scheduler_type",
            f"must be one of {SCHEDULER_TYPES}",
            self.scheduler_type,
        )
        _check(isinstance(self.return_logprobs, bool), "return_logprobs", "must be a bool", self.return_logprobs)
        _check(
            _is_number(self.cpu_offload_space) and 0 <= self.cpu_offload_space < float("inf"),
            "cpu_offload_space",
            "must be a finite number >= 0 (GiB)",
            self.cpu_offload_space,
        )
        _check(
            _is_int(self.max_queue_size) and self.max_queue_size >= 0,
            "max_queue_size",
            "must be an integer >= 0 (0: unbounded)",
            self.max_queue_size,
        )
        _check(
            self.use_cuda_graph is None or isinstance(self.use_cuda_graph, bool),
            "use_cuda_graph",
            "must be None (auto) or a bool",
            self.use_cuda_graph,
        )
        _check(
            self.overlap_scheduling is None or isinstance(self.overlap_scheduling, bool),
            "overlap_scheduling",
            "must be None (auto) or a bool",
            self.overlap_scheduling,
        )
        _check(isinstance(self.batch_invariant, bool), "batch_invariant", "must be a bool", self.batch_invariant)
        if self.batch_invariant:
            _check(
                self.attention_backend != "triton",
                "attention_backend",
                "must not be 'triton' with batch_invariant=True (the mode brings its own attention, with a fixed split "
                "of the keys: the engine's paged kernels split them by the batch)",
                self.attention_backend,
            )
            _check(
                self.decode_compile_config is None,
                "decode_compile_config",
                "must be None with batch_invariant=True (a compiled forward fuses and orders sums its own way)",
                self.decode_compile_config,
            )
        if self.decode_compile_config is not None:
            from transformers import CompileConfig

            _check(
                isinstance(self.decode_compile_config, CompileConfig),
                "decode_compile_config",
                "must be a transformers.CompileConfig or None",
                self.decode_compile_config,
            )
            compile_config = self.decode_compile_config
            _check(
                compile_config.options is None or compile_config.mode is None,
                "decode_compile_config",
                "torch.compile takes mode or options, not both: set mode=None when giving options",
                compile_config.mode,
            )
            _check(
                self.use_cuda_graph is False or not (compile_config.options or {}).get("triton.cudagraphs"),
                "decode_compile_config",
                "options 'triton.cudagraphs' captures graphs itself while use_cuda_graph may (set it False)",
                compile_config.options,
            )
            _check(
                self.use_cuda_graph is False or compile_config.mode in COMPILE_MODES_WITHOUT_GRAPHS,
                "decode_compile_config",
                f"mode must be one of {COMPILE_MODES_WITHOUT_GRAPHS} while use_cuda_graph may capture graphs itself "
                "(or set use_cuda_graph=False)",
                self.decode_compile_config.mode,
            )
        _check(isinstance(self.fp32_logits, bool), "fp32_logits", "must be a bool", self.fp32_logits)
        _check(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {ATTENTION_BACKENDS}",
            self.attention_backend,
        )
        if self.max_model_len is not None:
            _check(
                _is_int(self.max_model_len) and self.max_model_len >= 2,
                "max_model_len",
                "must be an integer >= 2",
                self.max_model_len,
            )
        if self.seed is not None:
            _check(_is_int(self.seed), "seed", "must be an integer or None", self.seed)
        _check(
            self.speculative in SPECULATIVE_METHODS,
            "speculative",
            f"must be one of {SPECULATIVE_METHODS}",
            self.speculative,
        )
        for name in ("num_speculative_tokens", "speculative_disable_by_batch_size", "speculative_index_tokens"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, name, "must be an integer >= 1", value)
        _check(  # the verify graphs hold 1 + this many rows per sequence
            self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            "num_speculative_tokens",
            f"must be at most {MAX_SPECULATIVE_TOKENS}",
            self.num_speculative_tokens,
        )
        _check(
            isinstance(self.speculative_clear_on_weight_update, bool),
            "speculative_clear_on_weight_update",
            "must be a bool",
            self.speculative_clear_on_weight_update,
        )
        if self.speculative is None:  # kept, not refused: one config toggled by `speculative` alone is common
            for name in SPECULATIVE_SETTINGS:
                if getattr(self, name) != getattr(ContinuousBatchingConfig, name) and name not in _WARNED:
                    _WARNED.add(name)  # once a process: configs are copied (dataclasses.replace) and rebuilt
                    logger.warning("ContinuousBatchingConfig: %s has no effect while speculative is None", name)
