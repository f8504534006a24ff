"""The Hugging Face hub, seen from a machine that may not reach it.

`from_pretrained` (and `datasets.load_dataset`) given a hub id on a machine without network retry for about a
minute, then raise a traceback. A newcomer's first command deserves better: `check_hub_source` probes the hub once
(a TCP connect, a few seconds at most) before anything loads, and a hub id that is neither reachable nor cached is one
line saying what to do. Offline mode (`HF_HUB_OFFLINE=1`) is honoured as the hub's own libraries honour it.
"""

from __future__ import annotations

import os
import socket
import time
from urllib.parse import urlsplit

# How long the reachability probe waits for a TCP connection to the hub's endpoint.
PROBE_TIMEOUT_S = 3.0
# How long a failed probe is believed: one command checks several names (a worker's --model before and after its
# preload checks, its --tokenizer), and each probe of an unreachable hub may wait PROBE_TIMEOUT_S.
UNREACHABLE_MEMORY_S = 60.0
_unreachable_since: dict[str, float] = {}  # endpoint -> monotonic time of its last failed probe


class HubUnreachable(ValueError):
    """A hub id that cannot be loaded here: the hub cannot be reached and the id is not in the local cache."""


def missing_local_path(name: str, flag: str) -> None:
    """Raise when `name` is written as a path (see `is_local_path`) that does not exist.

    Raises:
        FileNotFoundError: naming the flag.
    """
    if name.startswith((".", "/", "~")) and not os.path.exists(os.path.expanduser(name)):
        raise FileNotFoundError(f"{flag} {name}: no such file or directory")


def is_local_path(name: str) -> bool:
    """Whether `name` names something on this machine (an existing path, or one written as a path) rather than a hub
    id: a hub id is never absolute and never starts with "." or "~"."""
    return os.path.exists(os.path.expanduser(name)) or name.startswith((".", "/", "~"))


def hub_reachable(timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub's endpoint (`HF_ENDPOINT`, default https://huggingface.co) opens. A
    failed probe is remembered for UNREACHABLE_MEMORY_S, so one command waits for it once.

    Args:
        timeout_s: how long to wait for the connection.
    """
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    failed_at = _unreachable_since.get(endpoint)
    if failed_at is not None and time.monotonic() - failed_at < UNREACHABLE_MEMORY_S:
        return False
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
            _unreachable_since.pop(endpoint, None)
            return True
    except OSError:
        _unreachable_since[endpoint] = time.monotonic()
        return False


def in_hub_cache(repo_id: str, repo_type: str = "model") -> bool:
    """Whether the local hub cache (`HF_HOME` / `HF_HUB_CACHE`) holds `repo_id` (its config.json for a model, any
    snapshot for a dataset)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if repo_type == "model":
        try:
            return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
        except ValueError:  # not a valid repo id
            return False
    folder = os.path.join(constants.HF_HUB_CACHE, f"{repo_type}s--{repo_id.replace('/', '--')}", "snapshots")
    return os.path.isdir(folder) and bool(os.listdir(folder))


def check_hub_source(name: str, flag: str, repo_type: str = "model", config: str | None = None) -> bool:
    """Whether hub id `name` must be loaded from the local cache only (`local_files_only=True`): in offline mode, or
    when the hub cannot be reached but the cache holds it. Call it for a name that is not a local path.

    Args:
        name: the hub id as the user gave it.
        flag: how the user gave it, for the message (e.g. "--model").
        repo_type: "model" or "dataset".
        config: a dataset's config as the user named it (`name:config`): named with it, and with the downloaded
            directory the message says to pass (`DIR:config`; DIR alone would not pick the config).
    Raises:
        HubUnreachable: the hub cannot be reached and the cache does not hold `name`; the message says what to do.
    """
    from huggingface_hub import constants

    offline = constants.HF_HUB_OFFLINE
    if not offline and hub_reachable():
        return False
    if in_hub_cache(name, repo_type):
        return True
    why = (
        "offline mode is on (HF_HUB_OFFLINE)"
        if offline
        else f"{urlsplit(constants.ENDPOINT).hostname} cannot be reached from this machine (no network?)"
    )
    download = f"hf download {name}" + (" --repo-type dataset" if repo_type == "dataset" else "")
    suffix = f":{config}" if config else ""
    raise HubUnreachable(
        f"{flag} {name}{suffix}: not a local path, {why}, and the Hugging Face cache does not hold it: download it "
        f"where there is network (`{download} --local-dir DIR`) and pass DIR{suffix}, or point HF_HOME at a cache "
        "that holds it"
    )


def first_line(error: BaseException) -> str:
    """An exception's message reduced to its first non-empty line (library errors run to paragraphs)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
