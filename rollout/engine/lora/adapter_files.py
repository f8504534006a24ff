"""The files of a PEFT adapter directory that peft reads (`adapter_config.json`, `adapter_model.safetensors` or
`.bin`), checked before it reads them: each a regular file, the config of a config's size. A FIFO in their place
would block peft's reader forever inside safetensors' native code, which holds Python's lock, so every thread of
the worker with it; a sparse config of gigabytes would be read and decoded whole. The config's settings that the
installed peft does not know are checked too (`check_known_settings`)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Collection

from rollout.config import FieldError

CONFIG_NAME = "adapter_config.json"  # peft.utils.CONFIG_NAME
WEIGHTS_NAMES = ("adapter_model.safetensors", "adapter_model.bin")  # peft's SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME
MAX_CONFIG_BYTES = 1 << 20  # a LoRA config is a few KB; its largest lists (target_modules, rank_pattern) stay far under


def check_adapter_files(path: str) -> None:
    """Refuse an adapter directory whose files peft would read are missing or not regular files, or whose config is
    over MAX_CONFIG_BYTES. A path that is no directory is left to peft (a hub id, or its error naming the path); in a
    directory without weights peft would look for a hub repository of the directory's name ("Repo id must be in the
    form ..."), so a missing file is named here.

    Args:
        path: the adapter directory.
    Raises:
        FieldError: ("lora") naming the file.
    """
    present = set()
    for name in (CONFIG_NAME, *WEIGHTS_NAMES):
        try:
            found = os.stat(os.path.join(path, name))  # (through a link: what peft would open)
        except FileNotFoundError:
            continue
        except OSError as error:
            raise FieldError("lora", f"cannot read {name} in {path!r}: {error.strerror or error}") from None
        if not stat.S_ISREG(found.st_mode):
            raise FieldError("lora", f"{name} in {path!r} is not a regular file (a pipe, a device or a directory)")
        if name == CONFIG_NAME and found.st_size > MAX_CONFIG_BYTES:
            reason = f"{name} in {path!r} is {found.st_size} bytes; an adapter's config is at most {MAX_CONFIG_BYTES}"
            raise FieldError("lora", reason)
        present.add(name)
    if os.path.isdir(path):
        if CONFIG_NAME not in present:
            raise FieldError("lora", f"no {CONFIG_NAME} in {path!r}: not a PEFT adapter directory (save_pretrained's)")
        if not present & set(WEIGHTS_NAMES):
            raise FieldError("lora", f"no {' or '.join(WEIGHTS_NAMES)} in {path!r}: the adapter's weights are missing")


# Settings a newer peft writes into every adapter's config that change nothing by themselves: metadata, and a setting
# read only beside a flag (`qalora_group_size` with `use_qalora`), which an older peft does not know either.
METADATA_SETTINGS = frozenset({"peft_version"})
DEPENDENT_SETTINGS = {"qalora_group_size": "use_qalora"}


def _off(value: object) -> bool:
    """Whether a setting's value leaves it off (None, false, "", an empty list or mapping)."""
    return value in (None, False, "") or (isinstance(value, (list, dict)) and not value)


def check_known_settings(path: str, known: Collection[str], peft_version: str) -> None:
    """Refuse a config setting the installed peft does not know (one a newer peft wrote), unless it is off.

    peft drops such a setting with only a Python warning and builds a plain LoRA config, so a future LoRA variant's
    flag would be served as plain LoRA: a wrong forward. A setting left at an "off" value (None, false, "", an empty
    list or mapping) changes nothing and is let through, as are `METADATA_SETTINGS` (a newer peft's version) and
    `DEPENDENT_SETTINGS` whose flag is off (or unknown too: the flag is named). A config that is not a JSON object is left to peft's error.

    Args:
        path: the adapter directory (its files already checked by `check_adapter_files`).
        known: the setting names of the installed peft's config class (`LoraConfig`'s fields).
        peft_version: the installed peft's version, for the message.
    Raises:
        FieldError: (the setting) naming it, its value and what to do.
    """
    try:
        with open(os.path.join(path, CONFIG_NAME), encoding="utf-8") as file:
            settings = json.load(file)
    except (OSError, ValueError):
        return
    if not isinstance(settings, dict):
        return
    for name, value in settings.items():
        if name in known or _off(value) or name in METADATA_SETTINGS:
            continue
        flag = DEPENDENT_SETTINGS.get(name)
        if flag is not None and (_off(settings.get(flag)) or flag not in known):
            continue  # its flag is off, or unknown too: refused by its own name then
        raise FieldError(
            name,
            f"{CONFIG_NAME} in {path!r} sets {name}={value!r}, which peft {peft_version} does not know (a newer "
            "peft's setting): peft would drop it and the adapter would be served as plain LoRA; upgrade peft "
            "(pip install -U peft) or push the model with adapters='merged'",
        )
