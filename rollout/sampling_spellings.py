"""Other tools' names for sampling fields, and the answer an unknown one gets: rollout's name for it (vLLM's
`max_tokens` is `max_new_tokens`), or the closest field to a typo."""

from __future__ import annotations

import difflib
from collections.abc import Collection
from typing import Any

# vLLM's SamplingParams names (TRL recipes and vLLM users write them) -> rollout's.
VLLM_SPELLINGS = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}


def unknown_field_reason(name: Any, known: Collection[str]) -> str:
    """Why `name` is refused as a sampling field, with rollout's name for it where it is another tool's (vLLM's
    `max_tokens`, `ignore_eos`) or a close spelling of a known field.

    Args:
        name: the unknown field's name.
        known: the sampling fields there are.
    """
    if not isinstance(name, str):
        return f"a sampling field's name is a string, got {name!r}"
    reason = f"unknown sampling field {name!r}"
    if name in VLLM_SPELLINGS:
        return f"{reason}: vLLM's name; rollout's is {VLLM_SPELLINGS[name]!r}"
    if name == "ignore_eos":
        return f"{reason}: vLLM's; in rollout, stop_token_ids=[] (no stop tokens) generates past the EOS"
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f"{reason}; did you mean {close[0]!r}?" if close else reason


def spelling_hints(names: Collection[str], known: Collection[str]) -> str:
    """The hint "; did you mean 'X' (for 'Y')?" for those of the unknown `names` a known name is close to (another
    tool's spelling, as vLLM's `max_tokens`, or a typo), or "" when none is.

    Args:
        names: the unknown names, as the caller gave them.
        known: the names there are.
    """
    guesses = []
    for name in sorted(names):
        close = (
            [VLLM_SPELLINGS[name]] if name in VLLM_SPELLINGS else difflib.get_close_matches(name, sorted(known), n=1)
        )
        if close and close[0] in known:
            guesses.append(f"{close[0]!r} (for {name!r})")
    return f"; did you mean {', '.join(guesses)}?" if guesses else ""
