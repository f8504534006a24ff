"""Checking values and naming what is wrong: `FieldError` (a ValueError naming the field) and the small checks the
configuration dataclasses share. Free of torch."""

from __future__ import annotations

import math
import numbers
import reprlib
from typing import Any


class FieldError(ValueError):
    """Bad input, naming the field that is wrong (the service turns it into an error reply carrying `field`)."""

    def __init__(self, field: str, reason: str):
        """
        Args:
            field: the field that is wrong (kept as the attribute `field`).
            reason: what is wrong with it (kept as `reason`).
        """
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def renamed(self, names: dict[str, str]) -> FieldError:
        """The same error under another layer's name for its field (`names`: ours -> theirs), else itself."""
        return FieldError(names[self.field], self.reason) if self.field in names else self


_SHORT = reprlib.Repr()  # attributes, not keywords: Python 3.10/3.11 take none
_SHORT.maxlist = _SHORT.maxtuple = 8
_SHORT.maxstring = _SHORT.maxother = 80


def _check(condition: bool, name: str, reason: str, value: Any) -> None:
    """Raise a FieldError naming the field `name` when `condition` is false (the value shown abridged: a huge bad
    value must not make a huge error message)."""
    if not condition:
        raise FieldError(name, f"{_SHORT.repr(value)} is invalid: {reason}")


def is_seconds(value: Any, zero: bool = False, inf: bool = False) -> bool:
    """Whether `value` is a number of seconds: a real number (no bool, no NaN: it passes no deadline comparison, and a
    wait given NaN returns at once), above 0, finite.

    Args:
        value: what the caller gave.
        zero: 0 counts too (a wait that only looks).
        inf: math.inf counts too (no deadline).
    """
    # numbers.Real: numpy scalars too (np.int64, np.float32), as queue.get and Event.wait take them
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        return False
    return (value > 0 or (zero and value == 0)) and (inf or value < math.inf)


def check_timeout(value: Any, name: str = "timeout") -> None:
    """Refuse a wait's timeout that is not None or a number of seconds >= 0 (`is_seconds`: a loop waiting on NaN
    would spin until whatever it waits for came, never timing out).

    Raises:
        FieldError: naming `name`.
    """
    if value is not None and not is_seconds(value, zero=True, inf=True):
        raise FieldError(name, f"must be None (no limit) or a number of seconds >= 0, got {_SHORT.repr(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def all_plain_ints(values: list | tuple) -> bool:
    """True when every item is a plain `int` (not a bool, not a numpy integer). Runs at C speed (`map(type, ...)`):
    a batch of long prompts is checked in milliseconds without holding the interpreter lock in Python bytecode,
    which would slow the engine thread's every lock hand-over (each torch op releases and retakes it)."""
    return set(map(type, values)) <= {int}


def lone_surrogate(text: str) -> str | None:
    """The first lone surrogate in `text` (JSON's "\\ud800" escapes make them: no tokenizer encodes one, no UTF-8
    file or message holds one), or None when `text` is valid Unicode. Runs at C speed on valid text.

    Args:
        text: the string to check.
    """
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return text[error.start]
    return None


def in_range(values: list | tuple, low: int, high: int) -> bool:
    """True when plain ints `values` all lie in [low, high) (C speed; empty: True)."""
    return not values or (low <= min(values) and max(values) < high)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _listed(name: str, value: Any) -> list | tuple:
    _check(isinstance(value, (list, tuple)), name, "must be a list", value)
    return value


def _token_ids(name: str, value: Any, whole: Any = None) -> tuple[int, ...]:
    """`value` as a tuple of token ids, or a FieldError naming `name` (showing `whole` when given)."""
    _check(
        isinstance(value, (list, tuple)) and all(_is_int(t) and t >= 0 for t in value),
        name,
        "must be a list of non-negative token ids" + (" per word" if whole is not None else ""),
        value if whole is None else whole,
    )
    return tuple(value)


# logit_bias: at most this many tokens, each biased by a finite number in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS].
MAX_LOGIT_BIAS_TOKENS, MAX_LOGIT_BIAS = 300, 100.0


def logit_bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """`value` (None, a map of token id -> bias, or (token id, bias) pairs) as sorted (token id, bias) pairs, or a
    FieldError naming logit_bias. Sizes are checked before any entry is looked at."""
    if value is None:
        return ()
    _check(
        isinstance(value, (dict, list, tuple)),
        "logit_bias",
        "must be a map of token id -> bias, or a list of (token id, bias) pairs",
        value,
    )
    _check(
        len(value) <= MAX_LOGIT_BIAS_TOKENS,
        "logit_bias",
        f"at most {MAX_LOGIT_BIAS_TOKENS} tokens (got {len(value)})",
        value,
    )
    pairs = value.items() if isinstance(value, dict) else value
    biases: dict[int, float] = {}
    for pair in pairs:
        _check(
            isinstance(pair, (list, tuple)) and len(pair) == 2, "logit_bias", "must hold (token id, bias) pairs", pair
        )
        token, bias = pair
        if isinstance(token, str) and 0 < len(token) <= 19 and token.isascii() and token.isdecimal():
            token = int(token)  # a JSON map's key
        _check(_is_int(token) and token >= 0, "logit_bias", "token ids must be integers >= 0", token)
        _check(
            _is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,  # False for nan and inf
            "logit_bias",
            f"the bias of token {token} must be a finite number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            bias,
        )
        _check(token not in biases, "logit_bias", "each token may be biased once", token)
        biases[token] = float(bias)
    return tuple(sorted(biases.items()))
