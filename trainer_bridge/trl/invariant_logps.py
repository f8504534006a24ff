"""`RolloutGRPOTrainer(batch_invariant=True)`: TRL's per-token log-probs computed as the rollout computed them.

TRL 1.16 scores completions with its fused head (`model(..., fused_lm_head=True)`: log-probs and entropies computed
chunk by chunk from the hidden states, the temperature applied in the model's dtype). Under `batch_invariant=True`
the trainer scores with the expression the engine uses instead, `torch.log_softmax(logits.float() / temperature)`
at each completion token, from a forward under `rollout.invariant.batch_invariant`: then the log-probs of the
rollout and of the trainer's old-policy forward agree bit for bit, and TRL's importance ratio is exactly 1 where the
weights are the same. Text models only (no images). An MoE model's load-balancing loss (`compute_aux_loss`) comes
from the same forward's router logits, as TRL's does.

`InvariantScoringMixin` puts that scoring under whatever a trainer mixes in before it: with `routing_replay`, the
replay's chunks (each routed as the rollout routed it) are each scored invariantly.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.invariant.mode import batch_invariant
from rollout.invariant.reductions import invariant_log_softmax

# TRL's keyword arguments that carry images (refused by name: the invariant forward is for text models).
IMAGE_ARGUMENTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def invariant_logps_and_entropies(
    trainer: Any,
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None = None,
    compute_entropy: bool = False,
    compute_aux_loss: bool = False,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """GRPOTrainer._get_per_token_logps_and_entropies, batch-invariant (module docstring).

    Args:
        trainer: the GRPOTrainer (its `temperature` and `accelerator`).
        model: the model TRL scores with (wrapped or not).
        input_ids, attention_mask: prompt + completion in TRL's layout (prompts left-padded, completions
            right-padded).
        logits_to_keep: the completion's width.
        batch_size: rows per forward (TRL's chunking of its memory peak).
        compute_entropy: also return each position's entropy at the temperature.
        compute_aux_loss: also return an MoE model's load-balancing loss (the mean over the forwards, as TRL's).
        extra: TRL's image arguments: refused when given.
    Returns:
        (log-probs (rows, logits_to_keep), entropies or None, the load-balancing loss or None).
    """
    given = sorted(name for name, value in extra.items() if value is not None)
    if given:
        raise ValueError(f"batch_invariant=True scores text models only; refused: {', '.join(given)}")
    batch_size = batch_size or input_ids.size(0)
    # A tensor, as the engine's sampler divides by one: on CUDA, dividing by a Python number multiplies by its
    # reciprocal, which rounds differently.
    temperature = torch.tensor(float(trainer.temperature), dtype=torch.float32, device=input_ids.device)
    logps, entropies, aux_losses = [], [], []
    router_logits = {"output_router_logits": True} if compute_aux_loss else {}
    with batch_invariant(trainer.accelerator.unwrap_model(model)):
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            outputs = model(input_ids=ids, attention_mask=mask, **router_logits)
            if compute_aux_loss:
                aux_losses.append(outputs.aux_loss)
            logits = outputs.logits[:, -logits_to_keep - 1 : -1]
            log_probs = invariant_log_softmax(logits.float() / temperature)
            completion = ids[:, -logits_to_keep:]
            logps.append(log_probs.gather(-1, completion.unsqueeze(-1)).squeeze(-1))
            if compute_entropy:
                entropies.append(-(log_probs.exp() * log_probs).sum(-1))
    aux_loss = torch.stack(aux_losses).mean() if compute_aux_loss else None
    return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, aux_loss


class InvariantScoringMixin:
    """GRPOTrainer's scoring, batch-invariant when the trainer's `batch_invariant` is set (module docstring)."""

    batch_invariant: bool = False

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        if self.batch_invariant:
            return invariant_logps_and_entropies(self, *args, **kwargs)
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)
