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
        default=engine.num_speculative_tokens,
        help="most draft tokens per sample and step",
    )
    add(
        "--speculative-disable-by-batch-size",
        type=int,
        default=engine.speculative_disable_by_batch_size,
        help="draft only while a step decodes at most this many samples (the long tail)",
    )
    add(
        "--speculative-index-tokens",
        type=int,
        default=engine.speculative_index_tokens,
        help="most tokens of finished samples kept to draft from",
    )
    add(
        "--speculative-clear-on-weight-update",
        action="store_true",
        help="forget every draft at a weight update (by default drafts, only proposals, outlive it)",
    )


def speculative_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `ContinuousBatchingConfig` fields the flags set.

    Raises:
        FieldError: a speculative setting changed without `--speculative` (it would have no effect: a user who
            expected it to turn speculation on is told so, not ignored).
    """
    if args.speculative is None:
        engine = ContinuousBatchingConfig()
        for name in SPECULATIVE_SETTINGS:
            if getattr(args, name) != getattr(engine, name):
                raise FieldError(name, "has no effect without speculative (--speculative suffix turns it on)")
    return {
        "speculative": args.speculative,
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_disable_by_batch_size": args.speculative_disable_by_batch_size,
        "speculative_index_tokens": args.speculative_index_tokens,
        "speculative_clear_on_weight_update": args.speculative_clear_on_weight_update,
    }
