"""`rollout-worker`'s checks that read small files, made before the model loads (minutes for a large one): the
model's config (its context, for `--max-model-len` and `--max-prompt-len`) and each `--lora` adapter's rank (its weights file's header, or
its adapter_config.json; for `--max-lora-rank`). Each refusal is the usage error the same mistake gets after loading; what these files cannot
tell (a config transformers cannot read, an adapter's tensors) is still checked after loading."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from rollout.cli.hub import HubUnreachable, check_hub_source, is_local_path
from rollout.config import ContinuousBatchingConfig
from rollout.engine.runner.model_context import config_context, model_context_of
from rollout.presets.catalog import is_preset
from rollout.service.launch.flags import lora_specs, served_model_name

__all__ = ["check_before_load", "check_context", "model_context", "model_context_of"]


def check_before_load(
    parser: argparse.ArgumentParser, args: argparse.Namespace, config: ContinuousBatchingConfig
) -> None:
    """Usage errors (`parser.error`) for flags the model's config or an adapter's config refutes: a
    `--max-prompt-len` above the model's context, a `--lora` adapter whose rank is above `--max-lora-rank`.

    Args:
        parser: rollout-worker's parser.
        args: the parsed flags.
        config: the engine settings the flags give (`flags.check_settings`).
    """
    if args.max_prompt_len is not None or config.max_model_len is not None:
        model_config = _model_config(args.model)
        context, ceiling = config_context(model_config), config_context(model_config, rope_scaled=True)
        check_context(parser, args, config.max_model_len, context, ceiling)
    for name, path in lora_specs(parser, args.lora, served_model_name(args)):
        rank = adapter_rank(os.path.expanduser(path))
        if rank is not None and rank > config.max_lora_rank:
            parser.error(
                f"--lora {name}={path}: rank {rank} is outside [1, max_lora_rank={config.max_lora_rank}]; raise "
                f"--max-lora-rank to {rank}"
            )


def check_context(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    max_model_len: int | None,
    context: int | None,
    ceiling: int | None = None,
) -> None:
    """Usage errors for a `--max-model-len` above the model's context (as vLLM refuses it: positions past it were
    never trained; a RoPE-scaled model's, YaRN's, is its scaled one, as vLLM derives it), and a `--max-prompt-len`
    above the context the worker serves.

    Args:
        parser: rollout-worker's parser.
        args: the parsed flags.
        max_model_len: the engine's `max_model_len` (`--max-model-len`), None for the model's context.
        context: the model's context (its max_position_embeddings), None where it is not known yet.
        ceiling: the most `--max-model-len` may be (`config_context(..., rope_scaled=True)`); None: `context`.
    """
    ceiling = ceiling or context
    if max_model_len is not None and ceiling is not None and max_model_len > ceiling:
        scaled = " (RoPE-scaled)" if ceiling != context else ""
        parser.error(f"--max-model-len {max_model_len}: above the model's context{scaled} of {ceiling} tokens")
    limit = max_model_len or context
    if args.max_prompt_len is not None and limit is not None and args.max_prompt_len > limit:
        what = f"--max-model-len {limit}" if max_model_len else f"the model's context of {limit} tokens"
        parser.error(f"--max-prompt-len {args.max_prompt_len}: above {what}")


def model_context(model: str) -> int | None:
    """The longest sequence `model` runs (its text config's max_position_embeddings), read from its config alone;
    None for a built-in model, or a config that cannot be read here (loading the model says why).

    Args:
        model: `--model` as given: a local directory or a hub id.
    """
    return config_context(_model_config(model))


def _model_config(model: str) -> Any:
    """`model`'s config read alone (None for a built-in model, or one that cannot be read here)."""
    if is_preset(model):
        return None
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        cached_only = False if is_local_path(model) else check_hub_source(model, "--model")
        return AutoConfig.from_pretrained(os.path.expanduser(model), local_files_only=cached_only)
    except (HubUnreachable, ValueError, OSError, KeyError, StrictDataclassError):
        return None


def adapter_rank(path: str) -> int | None:
    """The highest LoRA rank of a PEFT adapter directory: its `lora_A` tensors' rows, read from the header of its
    adapter_model.safetensors (no tensor is loaded), else its adapter_config.json's `r` when no `rank_pattern` gives
    some modules another (which ones, only the model's module names tell); None when neither says (loading the
    adapter says why).

    Args:
        path: the adapter's directory.
    """
    weights = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(weights):
        from safetensors import safe_open

        try:
            with safe_open(weights, framework="numpy") as tensors:
                ranks = [tensors.get_slice(name).get_shape()[0] for name in tensors.keys() if ".lora_A." in name]
            return max(ranks) if ranks else None
        except Exception:  # noqa: BLE001 - a file safetensors cannot read: loading the adapter says why
            return None
    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as file:
            settings = json.load(file)
    except (OSError, ValueError):
        return None
    if not isinstance(settings, dict) or settings.get("rank_pattern"):
        return None
    rank = settings.get("r")
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None
