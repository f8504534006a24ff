"""Stand-ins for libraries the CPU suite cannot run: DeepSpeed ZeRO-3's partitioned parameters and its
`GatheredParameters` (the `zero3` fixture in conftest.py installs them)."""

from __future__ import annotations

import contextlib

import torch


class FakeZero3:
    """Partitions a model the way ZeRO-3 leaves it (empty `data`, `ds_id`, `ds_shape`) and stands in for
    `deepspeed.zero.GatheredParameters`, recording what is gathered at once."""

    def __init__(self):
        self.full: dict[int, torch.Tensor] = {}
        self.live: set[int] = set()
        self.peak = 0
        self.enters = 0
        self.gathered_sets: list[frozenset[int]] = []
        self.gather_counts: dict[int, int] = {}

    def partition(self, model: torch.nn.Module) -> None:
        for index, param in enumerate(model.parameters()):
            self.full[id(param)] = param.data.clone()
            param.ds_id = index
            param.ds_shape = param.shape
            param.data = torch.empty(0, dtype=param.dtype)

    @contextlib.contextmanager
    def GatheredParameters(self, params, modifier_rank=None):  # deepspeed's name
        assert modifier_rank is None
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        assert params and all(hasattr(param, "ds_id") for param in params)
        ids = {id(param) for param in params}
        assert not ids & self.live, "a parameter was gathered while already gathered"
        self.enters += 1
        self.live |= ids
        self.peak = max(self.peak, len(self.live))
        self.gathered_sets.append(frozenset(self.live))
        for param in params:
            self.gather_counts[id(param)] = self.gather_counts.get(id(param), 0) + 1
            param.data = self.full[id(param)].clone()  # modifier_rank=None: changes are discarded
        try:
            yield
        finally:
            for param in params:
                param.data.fill_(float("nan"))  # the gathered buffer is freed / reused: aliases of it go stale
                param.data = torch.empty(0, dtype=param.dtype)
            self.live -= ids
