"""Routing replay in the trainer (R3): the training forward of an MoE model routes every token to the experts the
rollout chose for it, so a near-tie in a router that flipped between the two forwards (different kernels, batch
shapes, bf16 rounding) no longer changes the token's whole computation.

`routing_replay(model, routes)` wraps the forward(s) that score completions; `routes_for(completions, ...)` builds
the routes tensor from the completions' recorded `prompt_routes` and `routes`, aligned with the batch's input_ids.
Inside, each router still computes its own scores; only its expert choice (its `torch.topk` over the experts) takes
the given ids, and the chosen experts' weights are the router's own scores at those ids, normalised by the model's
own code, so gradients reach the router as in the model's training path.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from rollout.engine.moe.router_taps import Tap, attach, detach, num_experts
from rollout.engine.moe.routes import find_routers, routers_refusal

__all__ = ["RouteReplay", "routes_for", "routing_replay"]


@contextlib.contextmanager
def routing_replay(model: torch.nn.Module, routes: torch.Tensor) -> Iterator[None]:
    """Inside, every MoE router of `model` uses the expert ids of `routes` for the forwards' tokens.

    Args:
        model: a transformers MoE causal LM (or a PEFT / accelerate wrapper of one).
        routes: LongTensor (batch, sequence length, MoE layers, top_k), aligned with the `input_ids` of each forward
            inside; a row holding -1 lets the router decide for that token (padding, positions the rollout did not
            compute).
    Raises:
        ValueError: a dense model, or routes whose shape does not fit the model (layers, top_k) or a forward's
            tokens (named).
    """
    replay = RouteReplay(model, lambda: routes)
    try:
        replay.check(routes)
        yield
    finally:
        replay.close()


class _ReplayTap(Tap):
    """Gives one MoE layer's router the ids of the replay's current routes."""

    replaces = True

    def __init__(self, replay: RouteReplay, layer: int):
        super().__init__()
        self.replay, self.layer = replay, layer

    def see(self, indices: torch.Tensor) -> torch.Tensor | None:
        routes = self.replay.current()
        if routes is None:
            return None
        self.replay.check(routes)
        wanted = routes[:, :, self.layer, :].reshape(-1, routes.shape[3])
        rows = indices.reshape(-1, indices.shape[-1])
        shape = self.replay.input_shape
        if shape is not None and tuple(routes.shape[:2]) != shape:
            raise ValueError(
                f"routing_replay: routes for {tuple(routes.shape[:2])} tokens, the forward's input_ids {shape}"
            )
        if rows.shape[0] != wanted.shape[0]:
            raise ValueError(
                f"routing_replay: the forward routes {rows.shape[0]} tokens, routes cover "
                f"{routes.shape[0]} x {routes.shape[1]} = {wanted.shape[0]}"
            )
        given = wanted.to(rows.device, torch.long)
        decided = (given >= 0).all(-1, keepdim=True)
        return torch.where(decided, given, rows).reshape(indices.shape)


class RouteReplay:
    """Taps on every MoE router of a model that route the forwards of the thread that made it (and any recomputation
    in backward, which CUDA's autograd runs on a thread of its own; never an engine step's) by the tensor `current()`
    returns at that moment (None: the routers decide), until `close()`. A trainer keeps one for its training steps:
    the routes of a step must also route gradient checkpointing's recomputation during backward."""

    def __init__(self, model: torch.nn.Module, current: Callable[[], torch.Tensor | None]):
        """
        Raises:
            ValueError: a dense model, or routers with different top_k.
        """
        self.routers = find_routers(model)
        refusal = routers_refusal(self.routers, model)
        if refusal is not None:
            raise ValueError(f"routing_replay: {refusal}")
        self.top_k = self.routers[0].top_k
        self.experts = min(num_experts(router) for router in self.routers)
        self.current = current
        # The last routes checked whole, and their version counter then (one device read per tensor and change: a
        # buffer refilled in place between forwards is checked again).
        self._checked: tuple[torch.Tensor, int] | None = None
        # (batch, sequence) of the model's last forward on each thread: another thread's forward of the same model
        # (its routers left alone) must not change what this thread's routes are checked against.
        self._shapes = threading.local()
        self._shape_hook = model.register_forward_pre_hook(self._note_shape, with_kwargs=True)
        self._taps = []
        for layer, router in enumerate(self.routers):
            tap = _ReplayTap(self, layer)
            tap.activate()
            attach(router, tap)
            self._taps.append(tap)

    def check(self, routes: Any) -> None:
        """Refuse routes that cannot fit the model.

        Raises:
            ValueError: not an integer tensor (batch, sequence, layers, top_k), another layer count or top_k, an
                expert id out of range, or a token with some ids -1 and others given.
        """
        integer = isinstance(routes, torch.Tensor) and not routes.dtype.is_floating_point and routes.dtype != torch.bool
        if not integer or routes.dim() != 4 or routes.dtype.is_complex:
            raise ValueError("routing_replay: routes must be an integer tensor (batch, sequence, MoE layers, top_k)")
        if routes.shape[2] != len(self.routers) or routes.shape[3] != self.top_k:
            raise ValueError(
                f"routing_replay: routes have {routes.shape[2]} layers x top_k {routes.shape[3]}; the model has "
                f"{len(self.routers)} MoE layers with top_k {self.top_k}"
            )
        version = -1 if routes.is_inference() else routes._version  # (an inference tensor keeps no version)
        if self._checked is None or routes is not self._checked[0] or version != self._checked[1]:
            if routes.numel() and int(routes.max()) >= self.experts:
                raise ValueError(f"routing_replay: expert id {int(routes.max())} >= the {self.experts} experts")
            if routes.numel() and int(routes.min()) < -1:
                raise ValueError("routing_replay: an expert id below -1 (-1: the router decides)")
            if bool(((routes < 0).any(-1) & (routes >= 0).any(-1)).any()):  # its given ids would be dropped
                raise ValueError(
                    "routing_replay: a token with some expert ids -1 and others given: a token's top_k ids are all "
                    "given, or all -1 (the router decides)"
                )
            ordered = routes.sort(-1).values
            if bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()):
                raise ValueError("routing_replay: a token routed to the same expert twice")
            self._checked = (routes, version)

    @property
    def input_shape(self) -> tuple[int, ...] | None:
        """(batch, sequence) of the model's last forward on this thread (None: none, or not from input ids)."""
        return getattr(self._shapes, "value", None)

    def _note_shape(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        self._shapes.value = tuple(ids.shape[:2]) if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else None

    def close(self) -> None:
        """Detach the taps. Idempotent."""
        self._shape_hook.remove()
        for router, tap in zip(self.routers, self._taps):
            detach(router, tap)
        self._taps.clear()


def routes_for(
    completions: Sequence[Any],
    pad_to: int | None = None,
    padding_side: str = "right",
    prompt_pad_to: int | None = None,
) -> torch.Tensor:
    """The routes tensor of a batch of completions, aligned with its input_ids (-1 at padding and at each
    sequence's last token, which the rollout never ran through the model).

    Args:
        completions: objects with `prompt_routes` (prompt_len - 1, layers, top_k) and `routes` (tokens, layers,
            top_k), as returned with `return_routes` (a `Completion`, a `GenerationOutput`).
        pad_to: the padded length: of each whole sequence (prompt + completion), or with `prompt_pad_to` of the
            completion part; default the longest.
        padding_side: "right" or "left", for whole sequences.
        prompt_pad_to: TRL's layout: prompts left-padded to this length, then completions right-padded to `pad_to`.
    Returns:
        LongTensor (batch, sequence length, layers, top_k).
    Raises:
        ValueError: a completion without routes, routes of different shapes, or a length above the padding (named).
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    for name, value in (("pad_to", pad_to), ("prompt_pad_to", prompt_pad_to)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
    parts = []
    for index, completion in enumerate(completions):
        prompt, generated = getattr(completion, "prompt_routes", None), getattr(completion, "routes", None)
        if prompt is None or generated is None:
            raise ValueError(f"completions[{index}] carries no routes: sample it with return_routes=True")
        prompt, generated = np.asarray(prompt), np.asarray(generated)
        if prompt.ndim != 3 or generated.ndim != 3:
            raise ValueError(f"completions[{index}]: routes are (tokens, layers, top_k) arrays")
        parts.append((prompt, generated))
    shapes = {rows.shape[1:] for pair in parts for rows in pair if len(rows)}
    if len(shapes) > 1:
        raise ValueError(f"completions' routes have different shapes {sorted(shapes)}")
    layers, top_k = shapes.pop() if shapes else (0, 0)
    if prompt_pad_to is not None:
        longest = max((len(g) for _, g in parts), default=0)  # the completion part: the sampled tokens
        width = pad_to if pad_to is not None else longest
        total = prompt_pad_to + width
    else:
        total = pad_to if pad_to is not None else max((len(p) + len(g) + 1 for p, g in parts), default=0)
    out = torch.full((len(parts), total, layers, top_k), -1, dtype=torch.long)
    for row, (prompt, generated) in enumerate(parts):
        # Positions 0 .. prompt_len - 2: the prompt; prompt_len - 1 ..: the forwards that sampled each token.
        sequence = np.concatenate([prompt, generated]) if len(prompt) + len(generated) else np.zeros((0, layers, top_k))
        length = len(prompt) + len(generated) + 1  # the sequence's tokens: the last one has no routes
        if prompt_pad_to is not None:
            prompt_len = len(prompt) + 1
            if prompt_len > prompt_pad_to or len(generated) > total - prompt_pad_to:
                raise ValueError(f"completions[{row}] is longer than prompt_pad_to / pad_to")
            start = prompt_pad_to - prompt_len
        else:
            if length > total:
                raise ValueError(f"completions[{row}] has {length} tokens, above pad_to={total}")
            start = 0 if padding_side == "right" else total - length
        out[row, start : start + len(sequence)] = torch.from_numpy(sequence.astype(np.int64))
    return out
