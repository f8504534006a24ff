"""`rollout-worker`'s flags for vLLM's control routes on the HTTP API (`--enable-control-routes`, its key and the
directories it may read) and vLLM's `--enable-tokenizer-info-endpoint`, checked before the model loads."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("rollout.worker")
# The environment variable the control key is read from when --control-api-key is not given (kept out of `ps`).
CONTROL_API_KEY_VARIABLE = "ROLLOUT_CONTROL_API_KEY"


def add_control_arguments(add: Callable[..., Any]) -> None:
    """Add the flags (`add`: the parser's `add_argument`)."""
    add(
        "--enable-control-routes",
        action="store_true",
        help="serve vLLM's control routes on the HTTP API: /pause, /resume, /is_paused, /abort_requests, "
        "/reset_prefix_cache, /server_info, /get_world_size, /update_weights (a checkpoint directory), "
        "/v1/load_lora_adapter, /v1/unload_lora_adapter (default: off)",
    )
    add(
        "--control-api-key",
        default=None,
        help="the control routes need Authorization: Bearer <key> and no other key opens them, so a client holding "
        f"--api-key cannot pause or abort the others (default: the {CONTROL_API_KEY_VARIABLE} environment variable; "
        "none: the control routes take --api-key)",
    )
    add(
        "--control-allowed-dirs",
        nargs="+",
        default=[],
        metavar="DIR",
        help="directories /update_weights and /v1/load_lora_adapter may read checkpoints and adapters from (symbolic "
        "links resolved first; default: none, so both refuse every path)",
    )
    add(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve vLLM's GET /tokenizer_info: the tokenizer's settings and chat template (lm-eval's remote "
        "tokenizer reads it; default: off)",
    )


def key_refusal(key: str) -> str | None:
    """Why an API key could never be sent (None: it can): HTTP trims a header value's surrounding whitespace and
    carries no control characters, and the openai client sends header values as ASCII, so a key read with a trailing
    newline (from a secret's file) would answer every request 401."""
    odd = next((char for char in key if not " " <= char <= "~"), None)
    if odd is None and key != key.strip():
        odd = key[0] if key[0] == " " else key[-1]
    if odd is None:
        return None
    return f"holds {odd!r}: no HTTP client can send it in an Authorization header (printable ASCII only, no space at either end)"


def check_control_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, on_this_host: bool = True) -> None:
    """Usage errors for control flags that cannot work (no --http, an empty key, a directory that does not exist);
    a warning when the control routes are open to every holder of the generation key on a reachable address.

    Args:
        parser: rollout-worker's parser.
        args: the parsed flags.
        on_this_host: whether the worker runs here; False (a fleet's driver checking its workers' flags) leaves the
            directories and the warning to each worker's node.
    """
    asked = [
        flag
        for flag, value in (
            ("--enable-control-routes", args.enable_control_routes),
            ("--enable-tokenizer-info-endpoint", args.enable_tokenizer_info_endpoint),
            ("--control-api-key", args.control_api_key is not None),
            ("--control-allowed-dirs", bool(args.control_allowed_dirs)),
        )
        if value
    ]
    if args.http is None and asked:
        parser.error(f"{asked[0]} is for the HTTP API: give --http HOST:PORT too")
    if args.control_api_key == "":
        parser.error(f"--control-api-key (or {CONTROL_API_KEY_VARIABLE}): must not be empty")
    if args.control_api_key is not None and key_refusal(args.control_api_key) is not None:
        parser.error(f"--control-api-key (or {CONTROL_API_KEY_VARIABLE}): {key_refusal(args.control_api_key)}")
    routes_only = [flag for flag in asked if flag in ("--control-api-key", "--control-allowed-dirs")]
    if routes_only and not args.enable_control_routes:  # (the flag given, not both whatever was given)
        verb = "are" if len(routes_only) > 1 else "is"
        parser.error(f"{' and '.join(routes_only)} {verb} for the control routes: add --enable-control-routes")
    if not on_this_host:
        return
    for directory in args.control_allowed_dirs:
        if not os.path.isdir(os.path.expanduser(directory)):
            parser.error(f"--control-allowed-dirs {directory}: no such directory")
    if args.enable_control_routes and args.control_api_key is None and args.api_key is not None:
        logger.warning(
            "--enable-control-routes without --control-api-key: every client holding --api-key may pause, abort "
            "and update the weights"
        )
