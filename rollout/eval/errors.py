"""`rollout-eval`'s errors (no torch: the command's entry point imports this before anything heavy)."""

from __future__ import annotations


class EvalError(Exception):
    """What stops a run, as one line for the user (naming the flag, saying what to do); exit status 2."""


class EvalInterrupted(KeyboardInterrupt):
    """Ctrl-C after the samples were generated and their rows written: the message says where they are."""
