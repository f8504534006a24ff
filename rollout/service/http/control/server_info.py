"""`GET /server_info` and `GET /get_world_size` in vLLM's shapes, from what the worker serves: an orchestrator
written for vLLM finds the served model, its context length, the log-prob mode, the parallel layout and the LoRA
settings where it looks for them, and the policy version of the weights beside them."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
from typing import Any

import torch

from rollout import __version__
from rollout.config import dtype_name
from rollout.engine.manager.continuous_batching import ContinuousBatchingManager

# The engine's log-prob modes (`SamplingParams.logprob_mode`) under vLLM's `--logprobs-mode` names.
VLLM_LOGPROBS_MODES = {"processed": "processed_logprobs", "raw": "raw_logprobs"}
# Environment variables reported (vLLM reports its VLLM_* ones), never one whose name says it holds a secret.
REPORTED_ENVIRONMENT_PREFIXES = ("ROLLOUT_", "VLLM_")
SECRET_NAME_PARTS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def reported_environment(environment: dict[str, str]) -> dict[str, str]:
    """`vllm_env`: the ROLLOUT_* and VLLM_* variables of `environment`, sorted, less any whose name holds one of
    `SECRET_NAME_PARTS` (a key, token, secret, password, credential).

    Args:
        environment: the process's environment (`os.environ`).
    """
    return {
        name: value
        for name, value in sorted(environment.items())
        if name.startswith(REPORTED_ENVIRONMENT_PREFIXES)
        and not any(part in name.upper() for part in SECRET_NAME_PARTS)
    }


def engine_config(manager: ContinuousBatchingManager, model_name: str, model_path: str | None = None) -> dict[str, Any]:
    """vLLM's `vllm_config`, as JSON, for the worker's engine (one process, one device: every parallel size is 1).

    Args:
        manager: the worker's engine manager.
        model_name: the served name (`served_model_name`).
        model_path: where the model came from (`model`, as vLLM's: --model as given); None: the served name.
    """
    engine, config = manager.engine, manager.config
    model = engine.model
    mode = engine.intake.default_sampling.logprob_mode
    return {
        "model_config": {
            "model": model_path or model_name,
            "served_model_name": model_name,
            "architectures": list(getattr(model.config, "architectures", None) or [type(model).__name__]),
            "dtype": dtype_name(next(model.parameters()).dtype),
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,
            "logprobs_mode": VLLM_LOGPROBS_MODES.get(mode, mode),
        },
        "parallel_config": {
            "data_parallel_size": 1,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "world_size": 1,
        },
        "cache_config": {
            "block_size": config.block_size,
            "num_gpu_blocks": engine.num_blocks,
            "enable_prefix_caching": config.allow_block_sharing,
        },
        "scheduler_config": {"max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_batch_tokens},
        "lora_config": {"max_loras": config.max_loras, "max_lora_rank": config.max_lora_rank},
        "speculative_config": None
        if not config.speculative
        else {
            "method": config.speculative,
            "num_speculative_tokens": config.num_speculative_tokens,
        },
        "rollout_config": {field.name: _plain(getattr(config, field.name)) for field in dataclasses.fields(config)},
    }


def server_info(
    manager: ContinuousBatchingManager, model_name: str, config_format: str, model_path: str | None = None
) -> dict[str, Any]:
    """The body of `GET /server_info`: `vllm_config` (an object for config_format "json", its text for "text"),
    `vllm_env`, `system_env`, and the weights' `policy_version`. Arguments as `engine_config`'s, and
    `config_format` ("json" or "text")."""
    config = engine_config(manager, model_name, model_path)
    return {
        "vllm_config": config if config_format == "json" else str(config),
        "vllm_env": reported_environment(dict(os.environ)),
        "system_env": {
            "rollout_version": __version__,
            "torch_version": torch.__version__,
            "python_version": sys.version.split()[0],
            "platform": platform.platform(),
            "device": str(next(manager.engine.model.parameters()).device),
        },
        "policy_version": manager.engine.policy_version,
    }


def _plain(value: Any) -> Any:
    """A config value as JSON can hold it."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
