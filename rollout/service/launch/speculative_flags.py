"""`rollout-worker`'s speculative decoding flags (`--speculative suffix` and its settings), apart from the other
engine flags: they map one to one onto `ContinuousBatchingConfig`'s speculative fields."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from rollout.config import SPECULATIVE_METHODS, SPECULATIVE_SETTINGS, ContinuousBatchingConfig, FieldError


def add_speculative_arguments(add: Callable[..., Any]) -> None:
    """Add the flags (`add`: the parser's `add_argument`)."""
    engine = ContinuousBatchingConfig()
    add(
        "--speculative",
        choices=[method for method in SPECULATIVE_METHODS if method],
        default=None,
        help="speculative decoding: suffix drafts each sample's next tokens from its prompt's other samples (its "
        "group's, earlier rounds') and verifies them in one forward; the same tokens for the same seeds "
        "(default: off)",
    )
    add(
        "--num-speculative-tokens",
        type=int,
        default=None,  # unset, not the engine's value: typed without --speculative it is refused, not ignored
        help=f"most draft tokens per sample and step (default: {engine.num_speculative_tokens})",
    )
    add(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="draft only while a step decodes at most this many samples, the long tail "
        f"(default: {engine.speculative_disable_by_batch_size})",
    )
    add(
        "--speculative-index-tokens",
        type=int,
        default=None,
        help=f"most tokens of finished samples kept to draft from (default: {engine.speculative_index_tokens})",
    )
    add(
        "--speculative-clear-on-weight-update",
        action="store_true",
        help="forget every draft at a weight update (by default drafts, only proposals, outlive it)",
    )


def speculative_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `ContinuousBatchingConfig` fields the flags set (the engine's values where a flag is unset).

    Raises:
        FieldError: a speculative setting given (on the command line, or by its ROLLOUT_* variable) without
            `--speculative`, even at the engine's own value: it would have no effect, and a user who expected it to
            turn speculation on is told so, not ignored.
    """
    engine = ContinuousBatchingConfig()
    if args.speculative is None:
        for name in SPECULATIVE_SETTINGS:
            if getattr(args, name) not in (None, False):
                raise FieldError(name, "has no effect without speculative (--speculative suffix turns it on)")
    settings: dict[str, Any] = {"speculative": args.speculative}
    for name in SPECULATIVE_SETTINGS:
        value = getattr(args, name)
        settings[name] = getattr(engine, name) if value is None else value
    return settings
