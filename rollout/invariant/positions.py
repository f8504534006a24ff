"""Position ids numbered from each row's first unmasked token.

A transformers forward given `attention_mask` and no `position_ids` numbers every row 0, 1, 2, ... from its first
column, so a left-padded row's tokens sit at shifted positions: rotary embeddings are relative, so the scores agree in
exact arithmetic, but not in floating point. Numbering from the first unmasked token gives a row the positions it has
alone, whatever padding precedes it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position counted from its row's first unmasked token (0 there; padding before it gets 0).

    Args:
        attention_mask: (batch, sequence) of 0/1 (or bool), 1 where a token is real.
    Returns:
        (batch, sequence) int64 position ids.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def add_positions_from_mask(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """A forward pre-hook (`with_kwargs=True`): a call with a 2-D `attention_mask` and no `position_ids` gets
    `positions_from_mask(attention_mask)` for its own tokens, the mask's last columns (with a filled cache, the mask
    covers the cached tokens too, as transformers' `generate` passes it). Arguments passed by position (GPT-NeoX,
    GPT-J and CodeGen pass `input_ids` so to their decoder) are read by their names."""
    if args:
        args, kwargs = _by_name(module, args, kwargs)
    mask = kwargs.get("attention_mask")
    tokens = kwargs.get("input_ids")
    tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
    if kwargs.get("position_ids") is None and mask is not None and mask.dim() == 2 and tokens is not None:
        kwargs["position_ids"] = positions_from_mask(mask)[:, -tokens.shape[1] :]
    return args, kwargs


def _by_name(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The call's leading positional arguments given by the names of the forward's parameters they fill (those a
    keyword can fill; the rest stay positional)."""
    parameters = list(inspect.signature(module.forward).parameters.values())
    named = dict(kwargs)
    for index, value in enumerate(args):
        if index >= len(parameters) or parameters[index].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return args[index:], named
        if parameters[index].name in named:  # given twice: the forward's own error says so
            return args, kwargs
        named[parameters[index].name] = value
    return (), named
