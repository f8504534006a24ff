"""MoE routes recorded during rollout (`SamplingParams.return_routes`): for every token a step computes and every MoE
layer, the top-k expert ids the layer's router chose, read from transformers' own router modules.

Routers are the modules named `*TopKRouter` (any case) with a `top_k` (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral,
GPT-OSS, DeepSeek-V3, GLM-4-MoE, Jamba, ...). Each picks its experts with `torch.topk` over its expert scores; while
a router's forward runs, a torch function mode sees that call (the last one with k == top_k over the experts'
dimension: DeepSeek's group pre-selection is another) and copies the ids it returns into a persistent buffer
(layers, tokens, top_k). Nothing else in the model changes: the router computes exactly what it computes anyway.

- Off by default, and free when off: the hooks are installed at the first request that asks (`install`), and act
  only in steps where a request wants routes (or always once decode graphs capture them, like LoRA's hooks).
- After the forward the step's rows come down to the host in one queued copy (int16), and the engine writes each
  request's positions into its `RouteRows` when it resolves the step (`PendingRoutes.deliver`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from rollout.config import FieldError
from rollout.engine.batch import ScheduledBatch
from rollout.engine.request import Request
from rollout.engine.route_rows import RouteCache
from rollout.engine.transfer import HostCopy

ROUTER_CLASS = re.compile(r"top_?k_?router$", re.IGNORECASE)
DENSE_MODEL = "the model has no MoE router (a *TopKRouter module with top_k): routes exist only for MoE models"


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers, in layer order (empty for a dense model)."""
    return [
        module
        for module in model.modules()
        if ROUTER_CLASS.search(type(module).__name__) and isinstance(getattr(module, "top_k", None), int)
    ]


def num_experts(router: torch.nn.Module) -> int:
    """Experts a router chooses among (its `num_experts`, else its weight's rows)."""
    for name in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = getattr(router, name, None)
        if isinstance(value, int):
            return value
    return int(router.weight.shape[0])


class RouterTopK(TorchFunctionMode):
    """Inside one router's forward: sees its expert choice (`torch.topk` with k == top_k over `experts` scores) and
    hands the ids to `chosen(indices)`, which may return other ids to use instead (routing replay)."""

    def __init__(self, top_k: int, experts: int, chosen: Any):
        super().__init__()
        self.top_k, self.experts, self.chosen = top_k, experts, chosen

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in (torch.topk, torch.Tensor.topk):
            scores = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if k == self.top_k and dim in (-1, scores.dim() - 1) and scores.shape[-1] == self.experts:
                replaced = self.chosen(result.indices)
                if replaced is not None:
                    values = scores.gather(-1, replaced)
                    result = torch.return_types.topk((values, replaced))
        return result


@dataclass
class RoutePlan:
    """Which packed rows of a step belong to which positions of the requests that want routes."""

    requests: list[Request] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # each run's first sequence position
    rows: list[int] = field(default_factory=list)  # each run's first packed row
    counts: list[int] = field(default_factory=list)


def plan_route_rows(batch: ScheduledBatch) -> RoutePlan | None:
    """The step's rows to keep (None: no request in it wants routes, the usual case)."""
    plan = RoutePlan()
    offset = 0
    for seq in batch.sequences:
        if seq.request.routes is not None:
            plan.requests.append(seq.request)
            plan.positions.append(seq.start)
            plan.rows.append(offset)
            plan.counts.append(seq.num_tokens)
        offset += seq.num_tokens
    return plan if plan.requests else None


class PendingRoutes:
    """A step's routes on their way to the host."""

    def __init__(self, plan: RoutePlan, routes: torch.Tensor, cache: RouteCache):
        self.plan = plan
        self.cache = cache
        self._copy = HostCopy(routes)  # (tokens, layers, top_k) int16, a tensor of its own

    def deliver(self) -> None:
        """Write each run's rows into its request's routes (waits for the copy): after the routes of cached blocks
        it took, if any; then keep its full blocks' routes for others."""
        host = self._copy.tensor().numpy()
        plan = self.plan
        for request, position, row, count in zip(plan.requests, plan.positions, plan.rows, plan.counts):
            if request.routes.known_upto() < position:  # its first chunk after a cached prefix
                self.cache.fill(request, position)
            request.routes.write(position, host[row : row + count])
            self.cache.keep(request)


class RouteRecorder:
    """The route hooks of one model runner."""

    def __init__(self, model: torch.nn.Module, max_tokens: int, block_size: int, num_blocks: int):
        """
        Args:
            model: the served model.
            max_tokens: the most tokens of one forward (the buffer grows past it if ever needed).
            block_size: the KV cache's block size.
            num_blocks: its blocks (the route cache keeps a few more blocks' routes than the prefix cache can hold).
        """
        self.routers = find_routers(model)
        # Routes of full blocks by prefix hash: the block manager lets a request that wants routes take a cached
        # block only when its routes are here.
        self.cache = RouteCache(block_size, num_blocks + max_tokens // block_size + 1)
        self.top_k = max((router.top_k for router in self.routers), default=0)
        self._max_tokens = max_tokens
        self._device = next(model.parameters()).device
        self._handles: list[Any] = []
        self._modes: list[RouterTopK | None] = [None] * len(self.routers)
        self.buffer: torch.Tensor | None = None
        self.active = False
        self.layout_version = 0  # bumped when captured graphs would be stale (hooks added, buffer grown)

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def admit(self, request: Request) -> None:
        """Install the hooks for the first request that wants routes.

        Raises:
            FieldError: ("return_routes") the model is dense.
        """
        if request.routes is None:
            return
        if not self.routers:
            raise FieldError("return_routes", DENSE_MODEL)
        if not self.installed:
            self._install()

    def _install(self) -> None:
        self.buffer = torch.zeros(
            len(self.routers), self._max_tokens, self.top_k, dtype=torch.int32, device=self._device
        )
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_pre_hook(self._enter(layer)))
            self._handles.append(router.register_forward_hook(self._exit(layer)))
        self.layout_version += 1

    def _enter(self, layer: int) -> Any:
        router = self.routers[layer]

        def record(indices: torch.Tensor) -> None:
            rows = indices.reshape(-1, indices.shape[-1])
            if rows.shape[0] > self.buffer.shape[1]:
                raise RuntimeError(f"routes: {rows.shape[0]} tokens in one forward, above the buffer's")
            self.buffer[layer, : rows.shape[0], : rows.shape[1]].copy_(rows)
            return None

        def enter(module: torch.nn.Module, args: tuple) -> None:
            if self.active:
                mode = RouterTopK(router.top_k, num_experts(router), record)
                mode.__enter__()
                self._modes[layer] = mode

        return enter

    def _exit(self, layer: int) -> Any:
        def exit_(module: torch.nn.Module, args: tuple, output: Any) -> None:
            mode, self._modes[layer] = self._modes[layer], None
            if mode is not None:
                mode.__exit__(None, None, None)

        return exit_

    @contextlib.contextmanager
    def recording(self, num_tokens: int, wanted: bool, always: bool) -> Iterator[None]:
        """Inside: the hooks record one forward of `num_tokens` tokens when `wanted` (a request wants routes) or
        `always` (decode graphs capture the recording once for all)."""
        if not self.installed or not (wanted or always):
            yield
            return
        if num_tokens > self.buffer.shape[1]:
            self.buffer = torch.zeros(len(self.routers), num_tokens, self.top_k, dtype=torch.int32, device=self._device)
            self.layout_version += 1
        self.active = True
        try:
            yield
        finally:
            self.active = False
            for layer, mode in enumerate(self._modes):  # a forward that raised inside a router
                if mode is not None:
                    mode.__exit__(None, None, None)
                    self._modes[layer] = None

    def collect(self, plan: RoutePlan | None, num_tokens: int) -> PendingRoutes | None:
        """The routes of the forward just recorded, for `plan`'s requests (None when no request wants them)."""
        if plan is None or not self.installed:
            return None
        routes = self.buffer[:, :num_tokens].transpose(0, 1).to(torch.int16)  # (tokens, layers, top_k), a copy
        return PendingRoutes(plan, routes, self.cache)

    def close(self) -> None:
        """Remove the hooks and free the buffer. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.buffer = None


def as_numpy(rows: np.ndarray | None) -> np.ndarray | None:
    """Routes as the outputs carry them: int16 arrays (None stays None)."""
    return None if rows is None else np.asarray(rows, dtype=np.int16)
