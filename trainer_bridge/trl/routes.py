"""Routing replay for `RolloutGRPOTrainer(..., routing_replay=True)` (an MoE policy): the rollout records every
token's experts (`return_routes`), and each forward where TRL computes the completions' log-probs (the old-policy
and reference recomputations, and the loss forward) routes every token as the rollout did
(`trainer_bridge.route_replay`).

The routes of a generation round's rows are kept by the generation (`RolloutGeneration.last_routed`); the trainer
aligns them with TRL's batch (prompts left-padded, completions right-padded, as TRL pads them) when TRL scores the
round (its old-policy and reference forwards replay them chunk by chunk), and hands them to the training steps
through the round's inputs ("rollout_routes", split and shuffled with the other tensors by TRL itself). A training
step replays them around its forward and backward: gradient checkpointing recomputes the forward in backward.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.engine.moe.routes import find_routers, routers_refusal
from trainer_bridge.route_replay import RouteReplay, routes_for

ROUTES_KEY = "rollout_routes"


def check_routing_replay(trainer: Any, enabled: Any) -> bool:
    """Refuse, by name, routing replay where it cannot be honoured.

    Raises:
        ValueError: not a bool, a dense model, or multi-turn rollouts (tool tokens the rollout did not route).
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"routing_replay must be True or False, got {enabled!r}")
    if not enabled:
        return False
    model = trainer.accelerator.unwrap_model(trainer.model)
    refusal = routers_refusal(find_routers(model), model)
    if refusal is not None:
        raise ValueError(f"routing_replay=True: {refusal}")
    environments = getattr(trainer, "environment_factories", None) is not None
    if trainer.rollout_func is not None or getattr(trainer, "tools", None) or environments:
        raise ValueError(
            "routing_replay=True does not support rollout_func, tools or environment_factory yet (a later turn's "
            "tool-result tokens were never routed by the rollout)"
        )
    return True


class RoutingReplayMixin:
    """GRPOTrainer methods that replay the rollout's routes (`RolloutGRPOTrainer` mixes it in)."""

    routing_replay: bool = False
    _replays: list[RouteReplay] | None = None  # taps on each model TRL scores with (policy, reference), while training
    _active_routes: torch.Tensor | None = None  # what they route by now (None: the routers decide)
    _loss_forward = False  # inside a training (or evaluation) step whose loss forward set `_active_routes`

    def _replay_on(self, model: Any) -> None:
        """Tap `model`'s routers (once per model)."""
        router = find_routers(model)[0]
        replays = self._replays if self._replays is not None else []
        if not any(replay.routers[0] is router for replay in replays):
            replays.append(RouteReplay(model, lambda: self._active_routes))
        self._replays = replays

    def close_routing_replay(self) -> None:
        """Detach the replay's taps from the models (at the end of `train()`). Idempotent."""
        for replay in self._replays or []:
            replay.close()
        self._replays = None
        self._active_routes, self._loss_forward = None, False

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        if not self.routing_replay:
            return super()._generate_and_score_completions(inputs)
        output = super()._generate_and_score_completions(inputs)
        prompt_width, completion_width = output["prompt_ids"].size(1), output["completion_ids"].size(1)
        output[ROUTES_KEY] = self._aligned_routes(prompt_width + completion_width, completion_width)
        return output

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's training step; the loss forward's routes (set by `_compute_loss`) stay until its backward is done:
        gradient checkpointing recomputes the forward there, and it must route as the forward did."""
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._active_routes, self._loss_forward = None, False

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's evaluation step, its loss forward replayed; nothing of it is left for the next step."""
        try:
            return super().prediction_step(*args, **kwargs)
        finally:
            self._active_routes, self._loss_forward = None, False

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        routes = inputs.get(ROUTES_KEY) if self.routing_replay else None
        if routes is not None:
            self._replay_on(model)
            self._active_routes = routes.to(inputs["prompt_ids"].device)
            self._loss_forward = True
        return super()._compute_loss(model, inputs)

    def _aligned_routes(self, width: int, completion_width: int) -> torch.Tensor:
        """The round's routes, laid out as TRL's prompt + completion ids of `width` tokens."""
        rows = self.rollout.last_routed
        if rows is None:
            raise RuntimeError("routing_replay: the round's completions carry no routes")
        return routes_for(rows, pad_to=completion_width, prompt_pad_to=width - completion_width)

    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, *args, **kw
    ) -> tuple:
        if not self.routing_replay or self._loss_forward:  # a loss forward: its routes are active already
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kw
            )
        # The round's scoring (old policy, reference): its own rows, chunk by chunk.
        routes = self._aligned_routes(input_ids.size(1), logits_to_keep)
        if tuple(routes.shape[:2]) != tuple(input_ids.shape):
            raise RuntimeError(
                f"routing_replay: routes {tuple(routes.shape[:2])} for input_ids {tuple(input_ids.shape)}"
            )
        if "batch_size" in kw:
            batch_size = kw.pop("batch_size")
        elif args:
            batch_size, args = args[0], args[1:]
        else:
            batch_size = None
        batch_size = batch_size or input_ids.size(0)
        self._replay_on(model)
        results = []
        try:
            for start in range(0, input_ids.size(0), batch_size):
                end = min(start + batch_size, input_ids.size(0))
                self._active_routes = routes[start:end].to(input_ids.device)
                results.append(
                    super()._get_per_token_logps_and_entropies(
                        model, input_ids[start:end], attention_mask[start:end], logits_to_keep, batch_size, *args, **kw
                    )
                )
        finally:
            self._active_routes = None
        return _joined(results)


def _joined(results: list[tuple]) -> tuple:
    """TRL's (logps, entropies or None, aux loss or None) of several chunks as one call's."""
    logps = torch.cat([r[0] for r in results])
    entropies = None if results[0][1] is None else torch.cat([r[1] for r in results])
    aux = None if results[0][2] is None else torch.stack([r[2] for r in results]).mean()
    return logps, entropies, aux
