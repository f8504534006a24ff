"""One forward of two tokens before an engine is built, through an attention function that only records what each
attention layer hands it, so that a model whose attention the paged cache cannot serve is refused by name when the
engine is built, instead of every request ending in an error at its first step:

- a layer that calls its attention function without its forward's keyword arguments (StableLM, Nemotron, Falcon
  from transformers 5.25): the paged metadata (`rollout_metadata`) would never reach it;
- keys or values of other heads or sizes than the config gives (JetMoE's mixture of attention heads; a config whose
  `num_key_value_heads` the model does not use): the cache is sized from the config, and would not hold them.
- a forward that fails outright in the engine's form: every request's first step would fail the same way.

The forward is the one the engine runs (`input_ids`, `position_ids`, a ready-made mask, `use_cache=False`, the extra
keyword argument), in eval mode and without gradients; the recording function returns zeros, so no layer's arithmetic
matters. The model's attention implementation and training mode are restored whatever happens.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rollout.config import FieldError

PROBE_NAME = "rollout_probe"
PROBE_KWARG = "rollout_probe_mark"  # what the probe forward passes where the engine passes `rollout_metadata`
_RECORD = threading.local()  # `calls`: the list the probe forward running in this thread appends to


@dataclass(frozen=True)
class AttentionCall:
    """What one attention layer handed its attention function."""

    layer: str  # the attention module's class
    kwargs_passed: bool  # the forward's keyword arguments reached it
    kv_heads: int
    key_dim: int
    value_dim: int


def _recording_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The "rollout_probe" attention function: records the call, returns zeros of the attention output's shape."""
    calls = getattr(_RECORD, "calls", None)
    if calls is not None:
        passed = kwargs.get(PROBE_KWARG) is True
        calls.append(AttentionCall(type(module).__name__, passed, key.shape[1], key.shape[-1], value.shape[-1]))
    batch, heads, length, _ = query.shape
    return query.new_zeros(batch, length, heads, value.shape[-1]), None


def record_attention_calls(model: torch.nn.Module, forward: bool = True) -> list[AttentionCall] | None:
    """The attention calls of one two-token forward of `model` in the engine's form; None when transformers would not
    switch the model's attention to a registered function (the caller refuses that by name).

    Args:
        model: a transformers causal LM.
        forward: run the forward; False: only try the switch (and record nothing), for a model whose parameters
            are shards until a round gathers them.
    Raises:
        FieldError: ("model") the forward failed.
    """
    AttentionInterface.register(PROBE_NAME, _recording_attention)
    AttentionMaskInterface.register(PROBE_NAME, sdpa_mask)
    previous = model.config._attn_implementation
    # Every submodule's own flag: a trainer may keep parts in eval mode (frozen embeddings), which model.train(True)
    # would switch on again.
    training = [(module, module.training) for module in model.modules()]
    model.set_attn_implementation(PROBE_NAME)
    try:
        if model.config._attn_implementation != PROBE_NAME:
            return None
        if not forward:
            return []
        device = next(model.parameters()).device
        _RECORD.calls = calls = []
        model.eval()
        try:
            with torch.no_grad():
                model(
                    input_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
                    position_ids=torch.arange(2, device=device)[None],
                    attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device),
                    use_cache=False,
                    **{PROBE_KWARG: True},
                )
        except Exception as error:  # every request's first step would fail the same way
            raise FieldError(
                "model",
                f"{type(model).__name__}'s forward failed on two tokens in the form the engine runs it "
                f"({type(error).__name__}: {error})",
            ) from error
        return calls
    finally:
        _RECORD.calls = None
        for module, flag in training:
            module.training = flag
        model.set_attn_implementation(previous)


def check_attention_calls(calls: list[AttentionCall], model: torch.nn.Module, kv_heads: int, head_dim: int) -> None:
    """Refuse a model whose attention layers the paged cache cannot serve, from what `record_attention_calls` saw.

    Args:
        calls: the recorded calls.
        model: the model (named in the message).
        kv_heads, head_dim: the cache's shape, as read from the config.
    Raises:
        FieldError: ("model") no layer called an attention function, one dropped the keyword arguments, or one's
            keys or values are not `kv_heads` heads of `head_dim`.
    """
    kind = type(model).__name__
    if not calls:
        raise FieldError(
            "model", f"{kind}'s forward called no attention function: rollout's paged attention would not run"
        )
    for call in calls:
        if not call.kwargs_passed:
            raise FieldError(
                "model",
                f"{call.layer} calls its attention function without the keyword arguments its forward was given, so "
                "rollout's paged attention would not get its metadata: pass **kwargs through to the attention "
                "function, as transformers' own attention classes do",
            )
        if (call.kv_heads, call.key_dim, call.value_dim) != (kv_heads, head_dim, head_dim):
            raise FieldError(
                "model",
                f"{call.layer} gives its attention {call.kv_heads} key heads of {call.key_dim} (values of "
                f"{call.value_dim}), where the config gives {kv_heads} of {head_dim} (num_key_value_heads, head_dim): "
                "the paged cache, sized from the config, would not hold them",
            )
