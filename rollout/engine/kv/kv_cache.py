"""The paged K/V tensors of every layer, sized from `num_blocks` or from free memory, plus the CPU swap space.

Layout: one tensor of shape (num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim), so a block copy or
a swap moves a block of every layer in one indexing op. A batch-invariant engine on the CPU keeps each block head by
head instead, (..., num_blocks + 1, num_kv_heads, block_size, head_dim) (`heads_first`): its attention reads one KV
head's keys at a time, and a gather of whole (block_size * head_dim) rows is about twice as fast as one of head_dim
rows. The extra block is scratch space that no request owns.
Zero-initialised, and blocks that held a failed sample's non-finite KV are zeroed before reuse (`zero_blocks`);
attention leaves out slots a sequence has not written by selection anyway (`attention.py`), so what a block's
previous owner left there never reaches its new one.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from rollout.config import ContinuousBatchingConfig, FieldError
from rollout.engine.kv.transfer import to_device
from rollout.engine.scheduling.block_manager import cdiv

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(frozen=True)
class KVCacheShape:
    """What one block of one layer looks like, read from a transformers config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_model_config(cls, model_config: PretrainedConfig) -> KVCacheShape:
        """Read layers, KV heads and head dim from a transformers `PretrainedConfig` (text config for wrappers)."""
        config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        return cls(config.num_hidden_layers, num_kv_heads, head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of K and V for one block across all layers."""
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on `device`: the accelerator's free memory, or the host's available RAM for CPU."""
    if device.type == "cuda":  # free on the device, plus what torch's allocator holds cached but unused
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_num_blocks(
    config: ContinuousBatchingConfig, shape: KVCacheShape, dtype: torch.dtype, device: torch.device, max_model_len: int
) -> int:
    """`config.num_blocks`, or as many blocks as `max_memory_percent` of free memory holds, capped at what
    `max_num_seqs` sequences of `max_model_len` tokens could ever use.

    Raises:
        FieldError: ("num_blocks") the blocks asked for do not fit the device's free memory; ("max_memory_percent")
            not even one block fits.
    """
    per_block = shape.bytes_per_block(config.block_size, dtype)
    if config.num_blocks is not None:
        needed, free = (config.num_blocks + 1) * per_block, free_memory_bytes(device)  # + the scratch block
        if needed > free:
            raise FieldError(
                "num_blocks",
                f"{config.num_blocks} blocks of {per_block} bytes need {needed / GIB:.2f} GiB but {device} has "
                f"{free / GIB:.2f} GiB free; lower num_blocks (or max_memory_percent instead)",
            )
        return config.num_blocks
    percent = config.max_memory_percent
    if percent is None:
        percent = 0.9 if device.type == "cuda" else 0.05
    num_blocks = int(free_memory_bytes(device) * percent) // per_block
    num_blocks = min(num_blocks, config.max_num_seqs * cdiv(max_model_len, config.block_size))
    if num_blocks < 1:
        raise FieldError(
            "max_memory_percent",
            f"{percent} of free memory on {device} holds no KV block of {per_block} bytes; "
            "raise max_memory_percent or set num_blocks",
        )
    return num_blocks


def check_swap_space(
    config: ContinuousBatchingConfig, shape: KVCacheShape, dtype: torch.dtype, device: torch.device, num_blocks: int
) -> None:
    """Refuse a `cpu_offload_space` that holds no block (it gave no swap, without a word) or that the host's
    available RAM cannot hold (torch's allocation failed with a traceback, after the model had loaded).

    Raises:
        FieldError: ("cpu_offload_space") naming the size it needs or the RAM there is.
    """
    space = config.cpu_offload_space
    if not space:
        return
    per_block = shape.bytes_per_block(config.block_size, dtype)
    if int(space * GIB) < per_block:
        raise FieldError(
            "cpu_offload_space",
            f"{space:g} GiB holds no KV block of {per_block} bytes: give at least {per_block / GIB:.6f} GiB, or 0 to "
            "recompute preempted requests",
        )
    needed = int(space * GIB) // per_block * per_block
    free = free_memory_bytes(torch.device("cpu"))
    if device.type == "cpu":  # the cache itself comes out of the same RAM, first
        free -= (num_blocks + 1) * per_block
    if needed > free:
        raise FieldError(
            "cpu_offload_space",
            f"{space:g} GiB of swap need {needed / GIB:.2f} GiB but the host has {max(free, 0) / GIB:.2f} GiB "
            "available; lower cpu_offload_space",
        )


class PagedKVCache:
    """K/V storage for every layer, addressed by block id and slot; optional CPU swap blocks."""

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, config: ContinuousBatchingConfig, max_model_len: int, heads_first: bool
    ) -> PagedKVCache:
        """The cache an engine over `model` holds: its shape from the model's config, in the dtype and on the device
        of its parameters, of `resolve_num_blocks` blocks.

        Args:
            model: the served model.
            config: the engine's settings (block size, number of blocks or memory share, CPU swap space).
            max_model_len: the longest sequence (caps the blocks a memory share would give).
            heads_first: as `__init__`'s.
        Raises:
            FieldError: as `resolve_num_blocks`.
        """
        parameter = next(model.parameters())
        shape = KVCacheShape.from_model_config(model.config)
        num_blocks = resolve_num_blocks(config, shape, parameter.dtype, parameter.device, max_model_len)
        check_swap_space(config, shape, parameter.dtype, parameter.device, num_blocks)
        return cls(
            shape,
            num_blocks,
            config.block_size,
            parameter.dtype,
            parameter.device,
            config.cpu_offload_space,
            heads_first,
        )

    def __init__(
        self,
        shape: KVCacheShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        swap_space_gib: float = 0.0,
        heads_first: bool = False,
    ):
        """
        Args:
            shape: layers, KV heads and head dim.
            num_blocks: device blocks.
            block_size: tokens per block.
            dtype, device: of the K/V tensors (the model's).
            swap_space_gib: CPU memory for swapped-out blocks (0: none).
            heads_first: lay each block out (num_kv_heads, block_size, head_dim) instead of (block_size,
                num_kv_heads, head_dim); blocks are copied, swapped and zeroed alike either way.
        """
        self.shape = shape
        self.heads_first = heads_first
        self.num_blocks = num_blocks
        self.block_size = block_size
        # One block past the last is the scratch block: padded rows of a CUDA-graph decode write and read only there.
        self.scratch_block = num_blocks
        self.scratch_slot = num_blocks * block_size
        block = (shape.num_kv_heads, block_size) if heads_first else (block_size, shape.num_kv_heads)
        self._dims = (shape.num_layers, 2, num_blocks + 1, *block, shape.head_dim)
        self.num_swap_blocks = int(swap_space_gib * GIB) // shape.bytes_per_block(block_size, dtype)
        self._swap_dims = (shape.num_layers, 2, self.num_swap_blocks, *block, shape.head_dim)
        self.kv = torch.empty(0, dtype=dtype, device=device)
        self.swap: torch.Tensor | None = None
        self.restore()
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB), %d swap blocks",
            num_blocks,
            block_size,
            self.kv.numel() * dtype.itemsize / 2**20,
            self.num_swap_blocks,
        )

    @property
    def nbytes(self) -> int:
        """Bytes the K/V tensors hold on the device now (0 while released)."""
        return self.kv.numel() * self.kv.element_size()

    @property
    def is_released(self) -> bool:
        """True between `release()` and `restore()`."""
        return self.kv.numel() == 0

    def release(self) -> None:
        """Free the K/V tensors and the swap space (their memory goes back to the allocator); what they held is lost.
        Idempotent."""
        self.kv = self.kv.new_empty(0)
        self.swap = None

    def restore(self) -> None:
        """Allocate the K/V tensors (and the swap space) again, zeroed as at construction. Idempotent."""
        if self.is_released:
            self.kv = torch.zeros(self._dims, dtype=self.kv.dtype, device=self.kv.device)
        if self.num_swap_blocks and self.swap is None:
            pinned = self.kv.device.type == "cuda"
            self.swap = torch.zeros(self._swap_dims, dtype=self.kv.dtype, pin_memory=pinned)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) of one layer, each (num_blocks, block_size, num_kv_heads, head_dim), or (num_blocks,
        num_kv_heads, block_size, head_dim) when `heads_first`."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def write(self, layer_idx: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the keys/values of new tokens ((tokens, kv_heads, head_dim) each) at flat slot indices, in the
        cache's dtype (under autocast, e.g. a trainer's bf16 mixed precision, they come in the autocast dtype)."""
        if self.heads_first:  # (block, :, offset) of each token: an index_put over a (blocks, slots, ...) view
            blocks, offsets = slots // self.block_size, slots % self.block_size
            for half, new in enumerate((key, value)):
                self.kv[layer_idx, half].transpose(1, 2).index_put_((blocks, offsets), new.to(self.kv.dtype))
            return
        flat = (-1, self.shape.num_kv_heads, self.shape.head_dim)
        self.kv[layer_idx, 0].view(flat).index_copy_(0, slots, key.to(self.kv.dtype))
        self.kv[layer_idx, 1].view(flat).index_copy_(0, slots, value.to(self.kv.dtype))

    def _index(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        src, dst = zip(*pairs)
        return torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks src -> dst for every layer (copy-on-write)."""
        if pairs:
            index = to_device(list(zip(*pairs)), torch.long, self.kv.device)
            self.kv[:, :, index[1]] = self.kv[:, :, index[0]]

    def zero_slots(self, slots: list[int]) -> None:
        """Zero single token slots in every layer (the KV of draft tokens the verification rejected, which the
        PyTorch attention would otherwise read, masked, in a block it reads whole: masked NaN still poisons)."""
        if slots and not self.is_released:
            index = to_device(slots, torch.long, self.kv.device)
            blocks, offsets = index // self.block_size, index % self.block_size
            if self.heads_first:
                self.kv[:, :, blocks, :, offsets] = 0
            else:
                self.kv[:, :, blocks, offsets] = 0

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero device blocks in every layer (blocks that held a failed sample's non-finite KV, before reuse)."""
        if blocks and not self.is_released:
            self.kv.index_fill_(2, to_device(blocks, torch.long, self.kv.device), 0)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block, swap block) pairs to the CPU swap space (waits for the device: swapping is rare)."""
        if pairs:
            device_blocks, swap_blocks = self._index(pairs)
            self.swap[:, :, swap_blocks] = self.kv[:, :, device_blocks.to(self.kv.device)].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (swap block, device block) pairs back to the device (staged in pinned memory: no wait)."""
        if pairs:
            swap_blocks, device_blocks = self._index(pairs)
            blocks = to_device(self.swap[:, :, swap_blocks], self.kv.dtype, self.kv.device)
            self.kv[:, :, to_device(device_blocks, torch.long, self.kv.device)] = blocks
