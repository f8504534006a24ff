"""One forward of two tokens before an engine is built, through an attention function that only records what each
attention layer hands it (`AttentionCall`), so that a model whose attention the paged cache cannot serve is refused
by name when the engine is built (`attention_call_checks.py`), instead of failing every request at its first step or,
worse, answering wrongly.

The forward is the one the engine runs (`input_ids`, `position_ids`, a ready-made mask, `use_cache=False`, the extra
keyword argument), in eval mode and without gradients. Its two tokens are one ordinary token twice, both at
position 1: a layer that numbers its tokens by where they stand in the input, not by `position_ids`, gives them
different keys. The recording function returns zeros, so every row stays what its token and position make it. A
forward that fails outright is refused: every request's first step would fail the same way. The model's attention
implementations (every config's own) and training mode (`training_mode.py`) are restored whatever happens.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rollout.attention_settings import AttentionSettings
from rollout.config import FieldError
from rollout.engine.runner.training_mode import TrainingMode

PROBE_NAME = "rollout_probe"
PROBE_KWARG = "rollout_probe_mark"  # what the probe forward passes where the engine passes `rollout_metadata`
PROBE_POSITION = 1  # both probe tokens' position
_RECORD = threading.local()  # `calls`: the list the probe forward running in this thread appends to


@dataclass(frozen=True)
class AttentionCall:
    """What one attention layer handed its attention function."""

    layer: str  # the attention module's class
    module_id: int  # which module called (a layer that calls more than once per forward is seen so)
    layer_idx: int | None  # the module's `layer_idx`
    kwargs_passed: bool  # the forward's keyword arguments reached it
    kv_heads: int
    key_dim: int
    value_dim: int
    sliding_window: int | None  # the window it passed, if any
    causal: bool  # the module's `is_causal` (True when it has none)
    rows_alike: bool  # the two probe tokens (one token, one position) got the same keys


def _alike(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether two rows of keys are equal up to rounding (one token at one position, computed in one batch)."""
    first, second = first.float(), second.float()
    return bool((first - second).abs().max() <= 1e-3 * first.abs().max() + 1e-6)


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
        window = kwargs.get("sliding_window")
        calls.append(
            AttentionCall(
                layer=type(module).__name__,
                module_id=id(module),
                layer_idx=getattr(module, "layer_idx", None),
                kwargs_passed=kwargs.get(PROBE_KWARG) is True,
                kv_heads=key.shape[1],
                key_dim=key.shape[-1],
                value_dim=value.shape[-1],
                sliding_window=window if isinstance(window, int) and window > 0 else None,
                causal=getattr(module, "is_causal", True) is not False,
                rows_alike=key.shape[2] < 2 or _alike(key[0, :, 0], key[0, :, 1]),
            )
        )
    batch, heads, length, _ = query.shape
    return query.new_zeros(batch, length, heads, value.shape[-1]), None


def _ordinary_token(model: torch.nn.Module) -> int:
    """A token id that is none of the config's special ones (padding's embedding may be zeros, hiding positions)."""
    special: set[int] = set()
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    for config in (model.config, text, getattr(model, "generation_config", None)):
        # A model outside GenerationMixin (custom code) may have no generation_config.
        for name, value in (vars(config) if config is not None else {}).items():
            if name.endswith(("token_id", "token_ids", "token_index", "token_indices")):
                special.update(
                    v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int)
                )
    return next(token for token in range(1, 1 << 20) if token not in special)


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
    previous = AttentionSettings.of(model)
    training = TrainingMode.of(model)
    try:
        model.set_attn_implementation(PROBE_NAME)
        if model.config._attn_implementation != PROBE_NAME:
            return None
        if not forward:
            return []
        device = next(model.parameters()).device
        if device.type == "meta":
            raise FieldError(
                "model",
                f"{type(model).__name__}'s parameters are on the meta device, without values: load its weights first "
                "(from_pretrained, or load_state_dict(..., assign=True))",
            )
        _RECORD.calls = calls = []
        model.eval()
        try:
            with torch.no_grad():
                model(
                    input_ids=torch.full((1, 2), _ordinary_token(model), dtype=torch.long, device=device),
                    position_ids=torch.full((1, 2), PROBE_POSITION, dtype=torch.long, device=device),
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
        training.restore()
        previous.restore()
