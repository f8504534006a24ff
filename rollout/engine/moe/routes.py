"""MoE routes recorded during rollout (`SamplingParams.return_routes`): for every token a step computes and every MoE
layer, the top-k expert ids the layer's router chose, read from transformers' own router modules.

Routers are the modules named `*TopKRouter` (any case) with a `top_k` (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral,
GraniteMoE, GLM-4-MoE, Jamba, ...); one whose forward does not choose by `torch.topk` (PhiMoE) is refused
(`routers_refusal`). Each picks its experts with `torch.topk` over its expert scores; a tap
on each router (`router_taps.py`) sees that call (the one with k == top_k over the experts' dimension: DeepSeek's
group pre-selection is another) and copies the ids it returns into a persistent buffer (layers, tokens, top_k).
Nothing else in the model changes: the router computes exactly what it computes anyway.

- Off by default, and free when off: the taps are attached at the first request that asks (`admit`), and act only
  in steps where a request wants routes (or always once decode graphs capture them, like LoRA's hooks), on the
  engine's thread.
- After the forward the step's rows come down to the host in one queued copy (int16), and the engine writes each
  request's positions into its `RouteRows` when it resolves the step (`PendingRoutes.deliver`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from rollout.config import FieldError
from rollout.engine.kv.transfer import HostCopy
from rollout.engine.moe.router_taps import Tap, attach, detach, num_experts, picks_with_topk
from rollout.engine.requests.request import Request
from rollout.engine.requests.route_rows import ROUTE_DTYPE, RouteCache
from rollout.engine.scheduling.batch import ScheduledBatch

ROUTER_CLASS = re.compile(r"top_?k_?router$", re.IGNORECASE)
OTHER_ROUTER = re.compile(r"(router|gate)$", re.IGNORECASE)  # MoE routers of other names (Llama4Router, DbrxRouter)
MAX_EXPERTS = int(np.iinfo(ROUTE_DTYPE).max) + 1  # expert ids 0 .. MAX_EXPERTS - 1 fit a route row
DENSE_MODEL = "the model has no MoE router (a *TopKRouter module with top_k): routes exist only for MoE models"


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers, in layer order (empty for a dense model)."""
    return [
        module
        for module in model.modules()
        if ROUTER_CLASS.search(type(module).__name__) and isinstance(getattr(module, "top_k", None), int)
    ]


def routers_refusal(routers: list[torch.nn.Module], model: torch.nn.Module | None = None) -> str | None:
    """Why a model's routes cannot be read or replayed through these routers (None: they can): none (a dense model,
    or one whose routers are other modules: named when `model` is given), several top_k, or a router that does not
    choose by `torch.topk` (PhiMoE's sparsemixer)."""
    if not routers:
        others = sorted(
            {
                type(m).__name__
                for m in (model.modules() if model is not None else ())
                if OTHER_ROUTER.search(type(m).__name__)
            }
        )
        if others:
            return (
                f"the model routes experts with {', '.join(others)}, which rollout does not read: routes are read "
                "from transformers' *TopKRouter modules (with a top_k)"
            )
        return DENSE_MODEL
    if len({router.top_k for router in routers}) > 1:
        return "the model's routers choose different numbers of experts (top_k): routes need one top_k"
    for router in routers:
        if picks_with_topk(router) is False:
            return (
                f"{type(router).__name__} chooses its experts without torch.topk over them, so rollout can neither "
                "read nor replay its routes"
            )
    return None


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

    def deliver(self, cached_blocks: dict[int, int]) -> None:
        """Write each run's rows into its request's routes (waits for the copy): after the routes of cached blocks
        it took, if any; then keep its full blocks' routes for others (`cached_blocks`: the prefix cache's blocks by
        hash)."""
        host = self._copy.tensor().numpy()
        plan = self.plan
        for request, position, row, count in zip(plan.requests, plan.positions, plan.rows, plan.counts):
            refill = request.routes.refill
            if refill and position >= refill:  # its first chunk after the cached blocks it took
                self.cache.fill(request, refill)
                request.routes.refill = 0
            request.routes.write(position, host[row : row + count])
            self.cache.keep(request, cached_blocks)

    def keep(self, batch: ScheduledBatch, cached_blocks: dict[int, int]) -> None:
        """Offer the route cache the blocks of `batch`'s requests that filled since this step was delivered (a
        drafted step's verification rounds: their routes came with the step, their hashes with each round).

        Args:
            batch: a round's batch (its requests are among this step's).
            cached_blocks: the prefix cache's blocks by hash.
        """
        for seq in batch.sequences:
            if seq.request.routes is not None:
                self.cache.keep(seq.request, cached_blocks)


class _RecordTap(Tap):
    """Copies one MoE layer's expert ids into the recorder's buffer."""

    def __init__(self, recorder: RouteRecorder, layer: int):
        super().__init__()
        self.recorder, self.layer = recorder, layer

    def see(self, indices: torch.Tensor) -> None:
        rows = indices.reshape(-1, indices.shape[-1])
        buffer = self.recorder.buffer
        if rows.shape[0] > buffer.shape[1]:
            raise RuntimeError(f"routes: {rows.shape[0]} tokens in one forward, above the buffer's {buffer.shape[1]}")
        buffer[self.layer, : rows.shape[0], : rows.shape[1]].copy_(rows)
        return None


class RouteRecorder:
    """The route taps of one model runner."""

    def __init__(self, model: torch.nn.Module, max_tokens: int, block_size: int, num_blocks: int):
        """
        Args:
            model: the served model.
            max_tokens: the most tokens of one forward (the buffer grows past it if ever needed).
            block_size: the KV cache's block size.
            num_blocks: its blocks (the route cache keeps a few more blocks' routes than the prefix cache can hold).
        """
        self.routers = find_routers(model)
        self._model = model  # (the runner's own) named in a refusal
        self.top_k = max((router.top_k for router in self.routers), default=0)
        # Routes of full blocks by prefix hash: the block manager lets a request that wants routes take a cached
        # block only when its routes are here.
        self.cache = RouteCache(block_size, num_blocks + max_tokens // block_size + 1)
        self._max_tokens = max_tokens
        self._device = next(model.parameters()).device
        self._taps: list[_RecordTap] = []
        self.buffer: torch.Tensor | None = None
        self.layout_version = 0  # bumped when captured graphs would be stale (taps added, buffer grown)

    @property
    def installed(self) -> bool:
        return bool(self._taps)

    def refusal(self) -> str | None:
        """Why routes cannot be recorded for this model (None: they can): `routers_refusal`'s reasons, or expert ids
        that routes' int16 rows cannot hold (they would wrap to negative ids, -1 among them: "the router decides")."""
        reason = routers_refusal(self.routers, self._model)
        if reason is None:
            experts = max(num_experts(router) for router in self.routers)
            if experts > MAX_EXPERTS:
                return (
                    f"the model's routers choose among {experts} experts: routes hold expert ids as int16, so at "
                    f"most {MAX_EXPERTS} experts"
                )
        return reason

    def admit(self, request: Request) -> None:
        """Install the taps for the first request that wants routes.

        Raises:
            FieldError: ("return_routes") the model cannot give them (`refusal`).
        """
        if request.routes is None:
            return
        reason = self.refusal()
        if reason is not None:
            raise FieldError("return_routes", reason)
        if not self.installed:
            self.buffer = torch.zeros(
                len(self.routers), self._max_tokens, self.top_k, dtype=torch.int32, device=self._device
            )
            for layer, router in enumerate(self.routers):
                tap = _RecordTap(self, layer)
                attach(router, tap)
                self._taps.append(tap)
            self.layout_version += 1

    @contextlib.contextmanager
    def recording(self, num_tokens: int, wanted: bool, always: bool) -> Iterator[None]:
        """Inside (on this thread): the taps record one forward of `num_tokens` tokens when `wanted` (a request wants
        routes) or `always` (decode graphs capture the recording once for all)."""
        if not self.installed or not (wanted or always):
            yield
            return
        if num_tokens > self.buffer.shape[1]:
            self.buffer = torch.zeros(len(self.routers), num_tokens, self.top_k, dtype=torch.int32, device=self._device)
            self.layout_version += 1
        for tap in self._taps:
            tap.activate()
        try:
            yield
        finally:
            for tap in self._taps:
                tap.deactivate()

    def collect(self, plan: RoutePlan | None, num_tokens: int) -> PendingRoutes | None:
        """The routes of the forward just recorded, for `plan`'s requests (None when no request wants them)."""
        if plan is None or not self.installed:
            return None
        routes = self.buffer[:, :num_tokens].transpose(0, 1).to(torch.int16)  # (tokens, layers, top_k), a copy
        return PendingRoutes(plan, routes, self.cache)

    def close(self) -> None:
        """Detach the taps and free the buffer. Idempotent."""
        for router, tap in zip(self.routers, self._taps):
            detach(router, tap)
        self._taps.clear()
        self.buffer = None
