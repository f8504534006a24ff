"""`RolloutGRPOTrainer(batch_invariant=True)` skips TRL's old-policy forward.

TRL computes the old policy's log-probs with an extra no-grad forward of the whole batch for its importance-sampling
correction. Under `batch_invariant=True`, a token sampled with the weights the trainer holds now (policy lag 0) has
a rollout log-prob that *is* that forward's value, bit for bit: the trainer takes it from the round it just sampled
and skips the forward. A row it cannot vouch for (sampled by older weights, changed after sampling by a tool's
tokens, not in the round) keeps the forward for the whole batch, on every rank. So does a setup whose bits differ
or cannot be told apart: a device where the equality is not verified (CUDA: docs/concepts/logprobs.md), a rollout in
another dtype, a trainer under autocast, a PEFT policy whose reference is itself with the adapter off (beta != 0), a
policy training with a dropout (`lora_dropout`, a dropout module, or one a model's layers apply as a function: OPT's,
Seed-OSS's) or a router that draws at random.
Each decision is logged as `rollout/old_logps_forward_skipped` (1 or 0), and the first skip and the first refusal
are said in the log: a refusal for a setting whose bits differ (a dropout, an autocast, ...) as a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Devices on which the engine's log-probs under batch_invariant=True are verified equal to the trainer's invariant
# forward bit for bit. Not CUDA yet: on one H200 (2026-11-30) they differed by up to 0.16.
BITWISE_DEVICES = ("cpu",)


@dataclass
class SampledRound:
    """The last round's sampling log-probs of rows sampled with the current weights, keyed by (prompt, completion)
    token ids (equal rows of a group share one entry: equal tokens give equal log-probs)."""

    logprobs: dict[tuple[tuple[int, ...], tuple[int, ...]], list[float]] = field(default_factory=dict)

    @classmethod
    def of(cls, prompts: list[list[int]], completions: list[Any], lags: list[list[int]]) -> SampledRound:
        """The rows whose every token has lag 0.

        Args:
            prompts: each row's prompt token ids.
            completions: each row's completion (`token_ids`, `logprobs`).
            lags: each row's per-token policy lag.
        """
        rows = {}
        for prompt, completion, row_lags in zip(prompts, completions, lags):
            if not any(row_lags):
                rows[(tuple(prompt), tuple(completion.token_ids))] = list(completion.logprobs)
        return cls(rows)


def recorded_old_logps(
    trainer: Any,
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    compute_entropy: bool = False,
    **_: Any,
) -> torch.Tensor | None:
    """The old policy's log-probs from the last sampled round, when this call is TRL's old-policy forward (no grad,
    the policy model, no entropy) and every row is vouched for; None to run the forward.

    Args:
        trainer: the RolloutGRPOTrainer (its `rollout.last_round`, `model`, metrics).
        model, input_ids, attention_mask, logits_to_keep, compute_entropy: GRPOTrainer's
            `_get_per_token_logps_and_entropies` arguments (prompts left-padded, completions right-padded).
    Returns:
        (rows, logits_to_keep) float32 log-probs (0 past each completion's end), or None.
    """
    if torch.is_grad_enabled() or compute_entropy or model is not trainer.model:
        return None  # the loss's forward, an entropy, or the reference model: computed
    found = _from_round(getattr(trainer.rollout, "last_round", None), input_ids, attention_mask, logits_to_keep)
    reason = _unverified(trainer, input_ids.device.type)  # a setting whose bits differ, or may: said as a warning
    differs = reason is not None
    if reason is None and trainer.beta != 0.0 and trainer.ref_model is None:
        # A PEFT policy's reference is the same model with its adapter off: a call this function cannot tell apart.
        reason = "the reference log-probs come from the policy model (PEFT with beta != 0)"
    if reason is None and found is None:
        reason = "some rows were not sampled with the current weights as they are now"
    if reason is not None:
        found = None
    accelerator = trainer.accelerator
    if getattr(accelerator, "num_processes", 1) > 1:  # every rank runs the forward, or none (its collectives)
        everyone = accelerator.gather(torch.tensor([float(found is not None)], device=accelerator.device))
        if found is not None and float(everyone.min()) == 0.0:
            reason, found = "another rank runs it", None
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode]["rollout/old_logps_forward_skipped"].append(0.0 if found is None else 1.0)
    said = trainer.__dict__.setdefault("_old_logps_said", set())
    key = "kept" if found is None else "skipped"
    if key not in said:
        said.add(key)
        if found is None and differs:
            logger.warning(
                "batch_invariant: the rollout's log-probs may not equal the trainer's bit for bit, so TRL's "
                "old-policy forward is run: %s",
                reason,
            )
        elif found is None:
            logger.info("batch_invariant: TRL's old-policy forward is run: %s", reason)
        else:
            logger.info(
                "batch_invariant: TRL's old-policy forward is skipped: the rollout's log-probs are its values bit for "
                "bit (policy lag 0)"
            )
    return found


def _unverified(trainer: Any, device: str) -> str | None:
    """Why the rollout's log-probs may differ from this trainer's old-policy forward (None: they are its bits)."""
    if trainer.model.training and any(
        isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0 for module in trainer.model.modules()
    ):
        return "a dropout (lora_dropout, say) draws random masks in the trainer's forwards, not in the rollout's"
    if trainer.model.training and (random := _random_in_training(trainer.model)) is not None:
        return random
    if getattr(trainer.accelerator, "mixed_precision", "no") != "no":
        return f"the trainer computes under {trainer.accelerator.mixed_precision} autocast, the rollout does not"
    rollout = trainer.rollout
    unverified = sorted((set(getattr(rollout, "devices", ())) | {device}) - set(BITWISE_DEVICES))
    if unverified:
        return f"bit-for-bit equality is not verified on {', '.join(unverified)} yet"
    dtype = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
    others = sorted(set(getattr(rollout, "dtypes", ())) - {dtype})
    if others:
        return f"the rollout computes in {', '.join(others)}, the trainer in {dtype}"
    return None


# Dropout probabilities of configs whose layers call `F.dropout` themselves, with no dropout module to find: OPT's
# `dropout`, Seed-OSS's and Starcoder2's `residual_dropout`, and the other names transformers' configs use.
CONFIG_DROPOUTS = (
    "dropout", "residual_dropout", "hidden_dropout", "hidden_dropout_prob", "embedding_dropout", "embd_pdrop",
    "resid_pdrop", "activation_dropout", "ffn_dropout", "mlp_dropout",
)  # fmt: skip


def _random_in_training(model: Any) -> str | None:
    """Why a training-mode forward of `model` draws at random with no dropout module to show it (None: it does
    not): a dropout its layers apply as a function (its config's probability), PhiMoE's sparsemixer sampling its
    experts, a router jitter multiplying its input by noise."""
    config = getattr(model, "config", None)
    for each in (config, getattr(config, "text_config", None)):
        if each is None:
            continue
        if getattr(each, "model_type", None) == "phimoe":
            return "PhiMoE's router (sparsemixer) draws its experts at random in training mode"
        for name in ("router_jitter_noise", "input_jitter_noise"):
            noise = _number(each, name)
            if noise > 0:
                return f"{name}={noise} puts random noise into the router in training mode"
        for name in CONFIG_DROPOUTS:
            probability = _number(each, name)
            if probability > 0:
                return f"config.{name}={probability}: a dropout draws random masks in the trainer's forwards"
    return None


def _number(config: Any, name: str) -> float:
    """`config.name` when it is a number (0 otherwise: absent, another type, or a per-layer attribute)."""
    try:
        value = getattr(config, name, 0.0)
    except Exception:  # noqa: BLE001 - transformers raises for a per-layer attribute read as one (Gemma 4's)
        return 0.0
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _from_round(
    round_: SampledRound | None, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
) -> torch.Tensor | None:
    """Each row's recorded log-probs laid out as TRL's completions are, or None when a row is not recorded."""
    if round_ is None or not round_.logprobs:
        return None
    ids, mask = input_ids.tolist(), attention_mask.bool().tolist()
    out = torch.zeros(len(ids), logits_to_keep, dtype=torch.float32)
    split = len(ids[0]) - logits_to_keep
    for row, (tokens, visible) in enumerate(zip(ids, mask)):
        prompt = tuple(t for t, seen in zip(tokens[:split], visible[:split]) if seen)
        completion = tuple(t for t, seen in zip(tokens[split:], visible[split:]) if seen)
        logprobs = round_.logprobs.get((prompt, completion))
        if logprobs is None:
            return None
        out[row, : len(logprobs)] = torch.tensor(logprobs, dtype=torch.float32)
    return out.to(input_ids.device)
