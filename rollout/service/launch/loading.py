"""Loading what `rollout-worker` and `rollout-eval` run: the device, the model (a preset, a local directory or a hub
id) and its tokenizer."""

from __future__ import annotations

import difflib
import logging
import os
import re
from typing import Any

import torch

from rollout.cli.device_names import DEVICE_FORMS, check_device_name
from rollout.cli.hub import HubUnreachable, check_hub_source, first_line, is_local_path, missing_local_path
from rollout.presets.catalog import PRESETS
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
    check_device_name(spec, flag)  # one answer in every command (meta, mps, "" and tpu alike)
    try:
        device = torch.device(spec)
    except RuntimeError:  # a name torch does not know (tpu): its message lists devices rollout does not run on
        raise ValueError(f"{flag}: not a device rollout runs on; give {DEVICE_FORMS}") from None
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


def check_model_directory(name: str) -> None:
    """Refuse a local path that is no model directory, before `from_pretrained` takes a file for a hub id (a minute
    of retries offline, then an error about JSON or pickles) or asks for a `model_type` of a missing config.json.

    Args:
        name: what `--model` names (a hub id or a preset passes).
    Raises:
        ValueError: a file (naming the directory to pass instead), or a directory without config.json.
    """
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        folder = os.path.dirname(path) or "."
        raise ValueError(
            f"a file, not a model directory: pass the directory that holds config.json and the weights ({folder}?)"
        )
    # a PEFT adapter directory (adapter_config.json, its base named there) is left to from_pretrained, as before
    held = ("config.json", "adapter_config.json")
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, file)) for file in held):
        raise ValueError(
            "no config.json there, so not a Hugging Face model directory (save_pretrained(DIR) writes "
            "config.json beside the weights)"
        )


def load_model(name: str, dtype: torch.dtype | None, device: torch.device) -> torch.nn.Module:
    """A preset, or `from_pretrained` of a local directory / hub id as a causal LM, refusing a checkpoint that
    lacks some of its weights: `from_pretrained` would initialize them at random (a base model saved without its LM
    head, an encoder, a classifier), and every completion and score would be noise with no error said.

    Args:
        name: a preset, a local directory or a hub id (as `--model` takes it).
        dtype: the parameters' dtype (None: the checkpoint's; a preset's float32).
        device: where the model runs.
    Raises:
        HubUnreachable (a ValueError): a hub id this machine can neither download nor find in its cache.
        ValueError: a checkpoint that lacks weights (naming them), or one `from_pretrained` cannot read (truncated
            files, shapes that do not match the config); or what `from_pretrained` raises as ValueError.
        OSError: what `from_pretrained` raises (no such files).
    """
    preset = model_from_preset(name, dtype=dtype or torch.float32, device=device)
    if preset is not None:
        return preset.to(device)
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    missing_local_path(name, "--model")
    check_model_directory(name)
    try:
        cached_only = False if is_local_path(name) else check_hub_source(name, "--model")
    except HubUnreachable as error:  # a typo of a built-in model's name reads as a hub id: say which it is close to
        close = difflib.get_close_matches(name, [preset for preset in PRESETS if ":" not in preset], n=1)
        if not close:
            raise
        raise HubUnreachable(f"{error}; or did you mean the built-in model {close[0]!r}?") from None
    report = _HeldLoadReport()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            name, dtype=dtype or "auto", local_files_only=cached_only, output_loading_info=True
        )
    except (RuntimeError, SafetensorError) as error:  # a truncated file, a config its weights' shapes do not match
        report.say()  # transformers' error may refer to the report ("look at the above report")
        raise ValueError(f"its checkpoint cannot be loaded ({type(error).__name__}: {first_line(error)})") from None
    except StrictDataclassError as error:  # a config.json field of the wrong type ("max_position_embeddings": "512")
        raise ValueError(f"its config.json cannot be read ({type(error).__name__}: {first_line(error)})") from None
    finally:
        report.stop()
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # refused, naming them (and what the checkpoint held instead): transformers' table is not said
        saved_as = ", ".join(getattr(model.config, "architectures", None) or ()) or "unknown"
        unexpected = sorted(info.get("unexpected_keys") or ())
        held = f", and holds {len(unexpected)} it does not take ({_few(unexpected)})" if unexpected else ""
        if any(name.endswith("." + wanted) for name in unexpected for wanted in missing):  # the same, prefixed
            hint = "saved under other names (a wrapper's prefix, such as DDP's 'module.')? Save the unwrapped model"
        else:
            hint = (
                f"is it a causal LM (saved as {saved_as})? Save the model with its LM head (an AutoModelForCausalLM's "
                "save_pretrained)"
            )
        raise ValueError(
            f"its checkpoint lacks {len(missing)} weight(s) of {type(model).__name__} ({_few(missing)}), which would "
            f"be random{held}; {hint} and pass that directory"
        )
    report.say()  # unexpected weights, say: the model loads, and the user reads which were left out
    return model.to(device).eval()


def _few(names: list[str]) -> str:
    """The first three names, and how many more."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


class _HeldLoadReport(logging.Filter):
    """Holds back transformers' LOAD REPORT (its table of missing, unexpected and mismatched weights) while a model
    loads, to be said (`say`) unless `load_model`'s own refusal names what it lists."""

    LOGGER = "transformers.modeling_utils"  # where `from_pretrained` logs the report

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []
        logging.getLogger(self.LOGGER).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in str(record.msg):
            self.held.append(record)
            return False
        return True

    def stop(self) -> None:
        """Stop holding (what was held stays, for `say`)."""
        logging.getLogger(self.LOGGER).removeFilter(self)

    def say(self) -> None:
        """Log what was held, as transformers would have, once."""
        self.stop()
        held, self.held = self.held, []
        for record in held:
            logging.getLogger(self.LOGGER).handle(record)


class EmptyTokenizer(ValueError):
    """transformers built a tokenizer of at most one token: what AutoTokenizer gives a directory without tokenizer
    files for some models (GPT-2's), where every text encodes to no ids."""


# What a file a tokenizer was saved in may be named (transformers' vocabulary files, sentencepiece and tiktoken
# models, Mistral's tekken): only to choose what to say when loading failed, never to refuse a directory.
_TOKENIZER_FILE = re.compile(r"token|vocab|merges|spiece|sentencepiece|spm|tekken|\.model$", re.IGNORECASE)


def holds_no_tokenizer_files(name: str) -> bool:
    """Whether `name` is a local directory with no file that looks like a saved tokenizer's.

    Args:
        name: a --model or --tokenizer value (a directory, a hub id or a preset).
    """
    folder = os.path.expanduser(name)
    return os.path.isdir(folder) and not any(_TOKENIZER_FILE.search(file) for file in os.listdir(folder))


def _usable(tokenizer: Any, name: str) -> Any:
    """`tokenizer`, unless it is empty (`EmptyTokenizer`, naming `name`)."""
    if len(tokenizer) <= 1:
        raise EmptyTokenizer(
            f"transformers built an empty tokenizer from {name} ({len(tokenizer)} token, every text encodes to no "
            "ids): it holds no tokenizer files; save one there with tokenizer.save_pretrained(DIR)"
        )
    return tokenizer


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
        return _usable(AutoTokenizer.from_pretrained(tokenizer, local_files_only=cached_only), tokenizer), tokenizer
    preset = tokenizer_for(model)
    if preset is not None:
        return preset, model
    try:
        cached_only = False if is_local_path(model) else check_hub_source(model, "--model")
        return _usable(AutoTokenizer.from_pretrained(model, local_files_only=cached_only), model), model
    except (ValueError, OSError) as error:  # a model without a tokenizer still serves token ids
        logger.warning(
            "--model %s has no tokenizer (%s): it serves token ids only (stop strings and text endpoints are off); "
            "pass --tokenizer, or save the tokenizer into its directory",
            model,
            error,
        )
        return None, None
