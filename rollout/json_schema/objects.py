"""What of an object schema the grammar engine (xgrammar) cannot enforce, each seen to accept a violating instance
(xgrammar 0.2.8 and 0.2.9, strict mode: an absent `additionalProperties` allows no other key):
- `propertyNames` beside `properties` or `patternProperties`: a declared property may then take the other keys'
  schema (`{"a": "x"}` for an integer `a`);
- `patternProperties` beside `properties`, or with more than one pattern: a key both name may take either schema
  (the engine treats them as alternatives, JSON Schema asks for both);
- `minProperties` of 2 or more where keys beyond the declared ones are allowed: a key may then come twice
  (`{"p": true, "p": false}`), which a parser reads as one property, below the least count (a repeated key only
  lowers the count: `maxProperties`, and `minProperties` 1, hold).
"""

from __future__ import annotations

from typing import Any


def unenforced_object_part(schema: dict, where: str) -> tuple[str, str] | None:
    """(where, why) of the first object keyword of `schema` (itself only, not its subschemas) the engine cannot
    enforce, or None.

    Args:
        schema: one schema (a dict).
        where: its place in the whole schema, as error paths name it (".properties.a").
    """
    declared = _non_empty(schema.get("properties"))
    patterns = schema.get("patternProperties")
    patterns = patterns if isinstance(patterns, dict) and patterns else None
    if "propertyNames" in schema and (declared or patterns):
        beside = "properties" if declared else "patternProperties"
        return (
            f"{where}.propertyNames",
            f"beside {beside} is not enforced by the grammar engine (a declared key may take another schema)",
        )
    if patterns is not None and declared:
        return (
            f"{where}.patternProperties",
            "beside properties is not enforced by the grammar engine (a key both name may take either schema)",
        )
    if patterns is not None and len(patterns) > 1:
        return (
            f"{where}.patternProperties",
            "with more than one pattern is not enforced by the grammar engine (a key two patterns match may take "
            "either schema)",
        )
    least = schema.get("minProperties")
    if isinstance(least, int) and least >= 2 and _other_keys_allowed(schema, patterns):
        return (
            f"{where}.minProperties",
            "of 2 or more is not enforced by the grammar engine where keys beyond the declared properties are allowed "
            "(a key may come twice, and counts once)",
        )
    return None


def _non_empty(value: Any) -> bool:
    return isinstance(value, dict) and bool(value)


def _other_keys_allowed(schema: dict, patterns: dict | None) -> bool:
    """Whether keys other than the declared properties may come (strict mode: an absent additionalProperties allows
    none)."""
    if patterns is not None or "propertyNames" in schema:
        return True
    return any(schema.get(keyword, False) is not False for keyword in ("additionalProperties", "unevaluatedProperties"))
