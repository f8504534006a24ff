"""`multipleOf` as the grammar engine (xgrammar) enforces it: on a type of integers (null allowed beside), by a whole
number from 1 to `MAX_MULTIPLE`, with no bound or with integer bounds at most `MAX_MULTIPLE_SPAN` apart. Any other
it drops (checked against xgrammar 0.2.8 and 0.2.9), so `support.py` refuses it by name.
"""

from __future__ import annotations

import math
from typing import Any

MAX_MULTIPLE = 1024  # xgrammar ignores a larger multipleOf (it logs so)
MAX_MULTIPLE_SPAN = 9999  # nor one whose integer bounds are further apart


def is_number(value: Any) -> bool:
    """Whether a JSON value (as json.loads gives it) is a finite number: a bool is an int to Python, never to JSON.

    Args:
        value: the value.
    """
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def unenforced_multiple(schema: dict) -> str | None:
    """Why xgrammar would not enforce the schema's `multipleOf`, or None: it does on a type of integers (null allowed
    beside), by a whole number in [1, 1024], with no bound or with integer bounds at most 9,999 apart (with one
    bound, or further apart, it drops it).

    Args:
        schema: one part of a JSON schema that has `multipleOf`.
    """
    kind = schema.get("type")
    kinds = (
        {kind}
        if isinstance(kind, str)
        else {k for k in kind if isinstance(k, str)}
        if isinstance(kind, list)
        else set()
    )
    multiple = schema["multipleOf"]
    whole = isinstance(multiple, int) or (isinstance(multiple, float) and multiple.is_integer())
    if not ("integer" in kinds and kinds <= {"integer", "null"} and whole and not isinstance(multiple, bool)):
        return f"is enforced by the grammar engine only on integers, by a whole number from 1 to {MAX_MULTIPLE}"
    if not 1 <= multiple <= MAX_MULTIPLE:
        return f"is enforced by the grammar engine only on integers, by a whole number from 1 to {MAX_MULTIPLE}"
    low, high = _bound(schema, "minimum", "exclusiveMinimum", 1), _bound(schema, "maximum", "exclusiveMaximum", -1)
    if low is None and high is None:
        return None
    if low is None or high is None or high - low > MAX_MULTIPLE_SPAN:
        return (
            "is enforced by the grammar engine with no bound, or with a lower and an upper bound at most "
            f"{MAX_MULTIPLE_SPAN:,} apart"
        )
    return None


def _bound(schema: dict, inclusive: str, exclusive: str, upward: int) -> int | None:
    """The tightest integer bound one side's inclusive and exclusive keywords give (`upward` 1: the lowest integer
    allowed, -1: the highest), or None where neither is a finite number."""
    bounds = []
    value = schema.get(inclusive)
    if is_number(value):
        bounds.append(math.ceil(value) if upward > 0 else math.floor(value))
    value = schema.get(exclusive)
    if is_number(value):
        bounds.append(math.floor(value) + 1 if upward > 0 else math.ceil(value) - 1)
    if not bounds:
        return None
    return max(bounds) if upward > 0 else min(bounds)
