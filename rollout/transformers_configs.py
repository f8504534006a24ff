"""transformers' own config objects, accepted where rollout takes its own: a `transformers.ContinuousBatchingConfig`
(what TRL's transformers path and transformers' `generate_batch` users pass) becomes a rollout
`ContinuousBatchingConfig`, field by field.

Every field of transformers' config is either carried over (under rollout's name for the same concept), accepted
because rollout always behaves as that value asks, or refused with a `FieldError` naming it when it holds a value
rollout cannot honour. A field this module does not know (a newer transformers) is accepted only at its default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rollout.config import ContinuousBatchingConfig, FieldError

# transformers field -> rollout field, same meaning.
_SAME_CONCEPT = {
    "num_blocks": "num_blocks",
    "max_memory_percent": "max_memory_percent",
    "allow_block_sharing": "allow_block_sharing",
    "scheduler_type": "scheduler_type",
    "return_logprobs": "return_logprobs",
    "cpu_offload_space": "cpu_offload_space",
    "max_queue_size": "max_queue_size",
    "decode_compile_config": "decode_compile_config",
    "seed": "seed",
}
# None in transformers means "infer it"; rollout then keeps its own default.
_INFERRED_WHEN_NONE = {
    "max_batch_tokens": "max_batch_tokens",
    "max_requests_per_batch": "max_num_seqs",
    "use_async_batching": "overlap_scheduling",  # the same idea: the host's work hidden behind the device's
}
# Fields with no rollout counterpart: the values rollout's behaviour already matches, and why.
_ACCEPTED_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "max_blocks_per_request": (
        (None, 0),
        "sizes transformers' flash_attn_with_kvcache decode path, which rollout has not (0 turns it off)",
    ),
    "q_padding_interval_size": ((0,), "rollout pads decode graphs to fixed batch-size buckets, not by tokens"),
    "kv_padding_interval_size": ((0,), "rollout pads decode graphs to fixed batch-size buckets, not by tokens"),
    "varlen_compile_config": ((None,), "rollout compiles only the decode forward (decode_compile_config)"),
    "default_compile_level": ((0,), "pass decode_compile_config explicitly"),
    "safety_margin": ((None,), "rollout's swap space is exactly cpu_offload_space"),
    "auto_switch_to_flash": ((True,), "rollout always serves attention with its own paged kernels"),
    "cpu_offload_space_safety_threshold": ((0.8,), "rollout allocates exactly cpu_offload_space, never clamped"),
    "per_request_processors": ((False, True), "rollout's processors are always per request"),
    "drop_unsupported_processors": (
        (False, True),
        "rollout never drops a processor: an unsupported GenerationConfig field is an error naming it",
    ),
    "disable_nccl_graph_mixing": ((False, True), "rollout runs no tensor-parallel collectives"),
    "cpu_group_timeout": (None, "rollout runs no tensor-parallel process group"),  # any value: nothing to time out
    "use_default_compile_configs": ((None, False), "deprecated in transformers 5.11: pass decode_compile_config"),
    "max_cached_graphs": ((None,), "deprecated in transformers 5.13"),
}


def page_size_field() -> str:
    """The name of the page (block) size in the installed transformers' ContinuousBatchingConfig: `page_size`, or
    `block_size` in releases before the rename (5.17 has only `block_size`)."""
    from transformers import ContinuousBatchingConfig as TransformersConfig

    names = {field.name for field in dataclasses.fields(TransformersConfig)}
    return "page_size" if "page_size" in names else "block_size"


def _page_size(config: Any) -> int:
    """page_size, or block_size, its older name (newer releases copy a given block_size into page_size)."""
    block_size = getattr(config, "block_size", None)
    return config.page_size if block_size is None else block_size


def _use_cuda_graph(value: Any) -> bool | None:
    """transformers' (varlen, decode) pair or one bool for both; rollout captures decode steps only."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise FieldError("use_cuda_graph", f"{value!r} is invalid: expected a bool or a (varlen, decode) pair")
        varlen, decode = value
        if varlen:
            raise FieldError("use_cuda_graph", f"{value!r} is invalid: rollout captures decode steps only, not varlen")
        return decode
    return value


_CONVERTERS: dict[str, Callable[[Any], Any]] = {"use_cuda_graph": _use_cuda_graph}


def _default(config: Any, name: str) -> Any:
    field = next(f for f in dataclasses.fields(config) if f.name == name)
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def from_transformers(config: Any) -> ContinuousBatchingConfig:
    """A rollout `ContinuousBatchingConfig` from a `transformers.ContinuousBatchingConfig`.

    Args:
        config: transformers' config (any version: fields this module does not know must be at their default).
    Raises:
        FieldError: a field holds a value rollout cannot honour, naming it and why.
    """
    settings: dict[str, Any] = {"block_size": _page_size(config)}
    for field in dataclasses.fields(config):
        name, value = field.name, getattr(config, field.name)
        if name in ("page_size", "block_size"):
            continue
        if name in _SAME_CONCEPT:
            settings[_SAME_CONCEPT[name]] = value
        elif name in _INFERRED_WHEN_NONE:
            if value is not None:
                settings[_INFERRED_WHEN_NONE[name]] = value
        elif name in _CONVERTERS:
            settings[name] = _CONVERTERS[name](value)
        elif name in _ACCEPTED_VALUES:
            accepted, why = _ACCEPTED_VALUES[name]
            if accepted is not None and value not in accepted:
                raise FieldError(name, f"{value!r} is not supported by rollout ({why}); accepted: {list(accepted)}")
        elif value != _default(config, name):
            raise FieldError(name, f"{value!r} is not supported by rollout (a transformers field it does not know)")
    return ContinuousBatchingConfig(**settings)


def engine_config(config: Any) -> ContinuousBatchingConfig:
    """The engine's settings from what a caller passed: None (the defaults), a rollout `ContinuousBatchingConfig`,
    or transformers' (converted by `from_transformers`).

    Raises:
        FieldError: anything else, or a transformers field rollout cannot honour.
    """
    if config is None:
        return ContinuousBatchingConfig()
    if isinstance(config, ContinuousBatchingConfig):
        return config
    if type(config).__name__ == "ContinuousBatchingConfig" and type(config).__module__.startswith("transformers."):
        return from_transformers(config)
    raise FieldError(
        "continuous_batching_config",
        f"{type(config).__name__} is invalid: expected rollout's or transformers' ContinuousBatchingConfig",
    )
