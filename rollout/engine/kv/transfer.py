"""Host <-> device copies that never make the host wait for the device.

A step's inputs go up and its sampled tokens come down while the device may still be busy with earlier work.
PyTorch's default copies synchronise: `torch.tensor(values, device="cuda")` and `.to("cuda")` from pageable memory
wait for the stream, and `.tolist()` of a device tensor waits for everything queued before it. With overlapped
scheduling that would stall the host on the very forward it means to hide behind, so the engine's step path moves
data only through these helpers:

- `to_device`: values staged in pinned host memory, then an asynchronous copy. PyTorch's caching host allocator
  keeps the pinned buffer alive until the copy has run, so the caller may drop it at once.
- `HostCopy`: a device tensor queued for the host now (pinned destination + CUDA event); `tolist()` waits for that
  copy alone, later.

On CPU every copy is a plain synchronous one (there is nothing to overlap with).
"""

from __future__ import annotations

import array
import itertools
from typing import Any

import torch


def to_device(values: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a list, or a CPU tensor) as a tensor of `dtype` on `device`, without waiting for the device.

    Args:
        values: a (nested) list of numbers, or a CPU tensor.
        dtype: the result's dtype.
        device: where the result lives.
    """
    device = torch.device(device)
    host = values.to(dtype=dtype) if isinstance(values, torch.Tensor) else _host_tensor(values, dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# array.array type codes of the dtypes a step sends most: a flat list converts through `array` several times faster
# than through `torch.tensor`, which inspects every element.
_ARRAY_CODES = {torch.long: "q", torch.float32: "f", torch.float64: "d", torch.int32: "i"}


def _host_tensor(values: Any, dtype: torch.dtype) -> torch.Tensor:
    """`values` as a CPU tensor of `dtype`."""
    code = _ARRAY_CODES.get(dtype)
    if code is not None and isinstance(values, list) and values:
        try:
            if not isinstance(values[0], (list, tuple)):
                return torch.frombuffer(array.array(code, values), dtype=dtype)
            width = len(values[0])  # rows of equal length: one flat array, viewed as a matrix
            if width and all(len(row) == width for row in values):
                flat = array.array(code, itertools.chain.from_iterable(values))
                return torch.frombuffer(flat, dtype=dtype).view(len(values), width)
        except (TypeError, OverflowError):
            pass  # not plain numbers of that kind (e.g. floats for an integer dtype): let torch convert them
    return torch.tensor(values, dtype=dtype)


class HostCopy:
    """A device tensor on its way to host memory: the copy is queued at construction, waited for in `tolist()`."""

    def __init__(self, tensor: torch.Tensor):
        """
        Args:
            tensor: the device tensor to bring to the host (its values as of the work queued so far).
        """
        self._event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tensor.device))
        else:
            self._host = tensor

    def tensor(self) -> torch.Tensor:
        """The values in host memory, once the copy has landed (waits for it, and for nothing queued later)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host

    def tolist(self) -> list:
        """The values as Python numbers, once the copy has landed (`tensor()`)."""
        return self.tensor().tolist()
