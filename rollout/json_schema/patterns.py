"""A string schema's shape as the grammar engine (xgrammar) enforces it: its `pattern`, or a `format` it knows,
followed alone (beside either it drops `minLength` / `maxLength`, and beside a known format the `pattern`), and no
lookahead (`(?=...)`, `(?!...)`) in a `pattern` or a `patternProperties` name: xgrammar drops it there (its `regex`
constraint refuses one), so `"pattern": "^(?!foo).*$"` would let "foobar" through. `support.py` asks these of each
part of a schema it walks.
"""

from __future__ import annotations

# String formats xgrammar enforces (others are annotations); beside one it drops minLength, maxLength and pattern.
KNOWN_FORMATS = frozenset(
    {
        "email", "uuid", "date", "date-time", "time", "duration", "uri", "uri-reference", "uri-template", "ipv4",
        "ipv6", "hostname", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip


def beside_string_shape(schema: dict, where: str) -> tuple[str, str] | None:
    """A string's length bound beside its `pattern` or a `format` xgrammar knows, or a `pattern` beside such a
    format: xgrammar follows the pattern, or the format, alone.

    Args:
        schema: one part of a JSON schema (its subschemas are not looked at).
        where: that part's path in the whole schema (`.properties.name`, "" at the root): the answer's starts with it.
    Returns:
        (where, why) of the keyword xgrammar would drop, or None.
    """
    known_format = isinstance(schema.get("format"), str) and schema["format"] in KNOWN_FORMATS
    shape = "format" if known_format else "pattern" if "pattern" in schema else None
    if shape is None:
        return None
    for keyword in ("minLength", "maxLength", "pattern"):
        if keyword in schema and keyword != shape:
            return (
                f"{where}.{keyword}",
                f"beside {shape} is not enforced by the grammar engine (it follows {shape} alone)",
            )
    return None


def lookahead(schema: dict, where: str) -> tuple[str, str] | None:
    """A lookahead in the schema's `pattern` or in a `patternProperties` name (xgrammar drops it: what it guards is
    let through).

    Args:
        schema: one part of a JSON schema (its subschemas are not looked at).
        where: that part's path in the whole schema (`.properties.name`, "" at the root): the answer's starts with it.
    Returns:
        (where, why) of the pattern with a lookahead, or None.
    """
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and _has_lookahead(pattern):
        return f"{where}.pattern", "has a lookahead ((?=...) or (?!...)), which the grammar engine does not enforce"
    names = schema.get("patternProperties")
    for name in names if isinstance(names, dict) else ():
        if isinstance(name, str) and _has_lookahead(name):
            return (
                f"{where}.patternProperties.{name}",
                "has a lookahead ((?=...) or (?!...)), which the grammar engine does not enforce",
            )
    return None


def _has_lookahead(pattern: str) -> bool:
    """Whether a regex has a `(?=` or `(?!` group: not escaped, not inside a character class."""
    escaped = in_class = False
    for index, char in enumerate(pattern):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(" and pattern[index + 1 : index + 3] in ("?=", "?!"):
            return True
    return False
