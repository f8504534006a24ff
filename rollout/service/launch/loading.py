"""Loading what `rollout-worker` and `rollout-eval` run: the device, the model (a preset, a local directory or a hub
id) and its tokenizer."""

from __future__ import annotations

import logging

import torch

from rollout.cli.hub import check_hub_source, is_local_path, missing_local_path
from rollout.presets.names import model_from_preset, tokenizer_for

logger = logging.getLogger("rollout.worker")


def torch_device(spec: str, flag: str) -> torch.device:
    """The torch device `spec` names ("cpu", "cuda", "cuda:1", ...), checked against what this torch can run.

    Args:
        spec: the device as the user gave it.
        flag: how the user gave it, for the message (e.g. "--device cuda").
    Raises:
        ValueError: a malformed name, CUDA asked of a torch that has none, or a CUDA index not visible; the message
            says what to do.
    """
    try:
        device = torch.device(spec)
    except RuntimeError as error:
        raise ValueError(f"{flag}: {error}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag}: rollout runs on cpu or cuda devices, not {device.type}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            instead = "drop --gpu to run on the CPU" if flag.startswith("--gpu") else "run on --device cpu"
            raise ValueError(
                f"{flag}: torch {torch.__version__} ({build}) sees no CUDA device: install a CUDA build of torch "
                f"(https://pytorch.org/get-started/locally/) on a machine with a GPU, or {instead}"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{flag}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


def load_model(name: str, dtype: torch.dtype | None, device: torch.device) -> torch.nn.Module:
    """A preset, or `from_pretrained` of a local directory / hub id.

    Raises:
        HubUnreachable (a ValueError): a hub id this machine can neither download nor find in its cache.
        ValueError / OSError: what `from_pretrained` raises.
    """
    preset = model_from_preset(name, dtype=dtype or torch.float32, device=device)
    if preset is not None:
        return preset.to(device)
    from transformers import AutoModelForCausalLM

    missing_local_path(name, "--model")
    cached_only = False if is_local_path(name) else check_hub_source(name, "--model")
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype or "auto", local_files_only=cached_only)
    return model.to(device).eval()


def load_tokenizer(model: str, tokenizer: str | None) -> tuple[object | None, str | None]:
    """(the tokenizer, where it came from) for `--model model --tokenizer tokenizer`; (None, None) without one.

    Raises:
        ValueError / OSError: an explicit --tokenizer that cannot be loaded.
    """
    if tokenizer is not None and tokenizer.lower() == "none":
        return None, None
    from transformers import AutoTokenizer

    if tokenizer is not None:
        preset = tokenizer_for(tokenizer)
        if preset is not None:
            return preset, tokenizer
        cached_only = False if is_local_path(tokenizer) else check_hub_source(tokenizer, "--tokenizer")
        return AutoTokenizer.from_pretrained(tokenizer, local_files_only=cached_only), tokenizer
    preset = tokenizer_for(model)
    if preset is not None:
        return preset, model
    try:
        cached_only = False if is_local_path(model) else check_hub_source(model, "--model")
        return AutoTokenizer.from_pretrained(model, local_files_only=cached_only), model
    except (ValueError, OSError) as error:  # a model without a tokenizer still serves token ids
        logger.warning("--model %s has no tokenizer (%s): stop strings and text endpoints are off", model, error)
        return None, None
