"""What the attention probe's calls (`attention_probe.py`) must show for the paged cache to serve a model as
transformers' own `generate` runs it; anything else is refused by name (`FieldError` "model") when the engine is
built:

- every layer gets its forward's keyword arguments (StableLM, Nemotron, Falcon from transformers 5.25 drop them: the
  paged metadata, `rollout_metadata`, would never reach them);
- keys and values of the config's `num_key_value_heads` heads of `head_dim` (JetMoE's mixture of attention heads
  gives others): the cache is sized from the config;
- one call per attention module per forward (DiffLlama's two attention halves, HRM's and Dory's layers run several
  times over): the cache holds one set of keys per layer, and a second call's write would replace the first's;
- one call per layer of the config (`num_hidden_layers`), each with its own `layer_idx`: the cache is indexed by
  it, so two modules sharing an index would overwrite each other's keys, a module without one has no cache layer,
  and a layer that called nothing computes its attention some other way (itself, or through transformers' cache),
  which the paged cache would not serve;
- causal attention (a BERT-style LM head with `is_decoder=False` attends both ways under `generate`);
- positions from `position_ids` (BART-style decoders number their tokens from the input's own length: packed
  sequences would get wrong positions);
- a sliding-window layer passes its window to the attention function (Moshi's window lives only in transformers'
  cache and mask, which the paged attention does not use). transformers counts a layer as sliding when
  `config.layer_types` says so, or, without layer types, when the config sets `sliding_window`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from rollout.config import FieldError
from rollout.engine.runner.attention_probe import AttentionCall


def sliding_windows(config: Any) -> dict[int, int]:
    """The layers transformers runs with a sliding window, and their window (its own inference, from the config).

    Args:
        config: the model's text config.
    """
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return {}
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return dict.fromkeys(range(getattr(config, "num_hidden_layers", 0) or 0), window)
    return {index: window for index, kind in enumerate(layer_types) if kind == "sliding_attention"}


def check_attention_calls(
    calls: list[AttentionCall],
    model: torch.nn.Module,
    kv_heads: int,
    head_dim: int,
    windows: dict[int, int],
    num_layers: int,
) -> None:
    """Refuse a model whose attention layers the paged cache cannot serve (module docstring).

    Args:
        calls: what `record_attention_calls` saw.
        model: the model (named in the messages).
        kv_heads, head_dim: the cache's shape, as read from the config.
        windows: the sliding-window layers and their windows (`sliding_windows`).
        num_layers: the cache's layers (the config's `num_hidden_layers`).
    Raises:
        FieldError: ("model") naming the layer's class and what it does.
    """
    if not calls:
        raise FieldError(
            "model",
            f"{type(model).__name__}'s forward called no attention function: rollout's paged attention would not run",
        )
    per_module = Counter(call.module_id for call in calls)
    for call in calls:
        _check_call(call, per_module[call.module_id], kv_heads, head_dim, windows)
    _check_layers(calls, model, num_layers)


def _check_layers(calls: list[AttentionCall], model: torch.nn.Module, num_layers: int) -> None:
    """One call per cache layer, each module with a layer_idx of its own in range (module docstring)."""
    by_layer: dict[int, AttentionCall] = {}
    for call in calls:
        if not isinstance(call.layer_idx, int) or not 0 <= call.layer_idx < num_layers:
            _refuse(
                call,
                f"has layer_idx={call.layer_idx!r}, not one of the config's {num_layers} layers (num_hidden_layers): "
                "the paged cache finds a layer's keys and values by its layer_idx",
            )
        first = by_layer.setdefault(call.layer_idx, call)
        if first.module_id != call.module_id:
            _refuse(
                call,
                f"and {first.layer} are two attention modules with one layer_idx ({call.layer_idx}): the paged cache "
                "keeps one set of keys and values per layer_idx, and each module's would overwrite the other's",
            )
    # Indices past the last one called that no module holds: a model cut short of its config (a pruned model, a
    # self-draft's first layers), whose cache layers stay unused. Any other index that called nothing is a layer
    # the cache would not serve.
    held = {module.layer_idx for module in model.modules() if isinstance(getattr(module, "layer_idx", None), int)}
    cut = {index for index in range(max(by_layer, default=-1) + 1, num_layers) if index not in held}
    silent = sorted(set(range(num_layers)) - set(by_layer) - cut)
    if silent:
        shown = ", ".join(map(str, silent[:8])) + (f" and {len(silent) - 8} more" if len(silent) > 8 else "")
        raise FieldError(
            "model",
            f"{type(model).__name__}'s layers {shown} (of num_hidden_layers={num_layers}) called no attention "
            "function: they compute their attention some other way (inside the layer, or through transformers' own "
            "cache), or are layers of another kind, which rollout's paged attention would not serve",
        )


def _refuse(call: AttentionCall, what: str) -> None:
    raise FieldError("model", f"{call.layer} {what}")


def _check_call(call: AttentionCall, times: int, kv_heads: int, head_dim: int, windows: dict[int, int]) -> None:
    if not call.kwargs_passed:
        _refuse(
            call,
            "calls its attention function without the keyword arguments its forward was given, so rollout's paged "
            "attention would not get its metadata: pass **kwargs through to the attention function, as "
            "transformers' own attention classes do",
        )
    if (call.kv_heads, call.key_dim, call.value_dim) != (kv_heads, head_dim, head_dim):
        _refuse(
            call,
            f"gives its attention {call.kv_heads} key heads of {call.key_dim} (values of {call.value_dim}), where "
            f"the config gives {kv_heads} of {head_dim} (num_key_value_heads, head_dim): the paged cache, sized from "
            "the config, would not hold them",
        )
    if times > 1:
        _refuse(
            call,
            f"calls its attention function {times} times in one forward (two attention halves, or a layer run "
            "several times over): the paged cache keeps one set of keys and values per layer, and each call would "
            "overwrite the last one's",
        )
    if not call.causal:
        _refuse(
            call,
            "is not causal (is_causal=False: a BERT-style model without is_decoder=True attends to later tokens): "
            "rollout generates with causal attention",
        )
    if not call.rows_alike:
        _refuse(
            call,
            "gives one token at one position different keys by where it stands in the input: the model numbers its "
            "tokens itself and does not take position_ids (BART-style decoders), so packed sequences would get wrong "
            "positions",
        )
    window = windows.get(call.layer_idx) if call.layer_idx is not None else None
    if window is not None and call.sliding_window is None:
        _refuse(
            call,
            f"(layer {call.layer_idx}) is a sliding-window layer (config sliding_window={window}) but does not pass "
            "sliding_window to its attention function: transformers applies that window through its own cache and "
            "mask, which rollout's paged attention does not use",
        )
