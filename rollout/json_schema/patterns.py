"""A string schema's shape as the grammar engine (xgrammar) enforces it: its `pattern`, or a `format` it knows,
followed alone (beside either it drops `minLength` / `maxLength`, and beside a known format the `pattern`), and no
lookahead (`(?=...)`, `(?!...)`) in a `pattern` or a `patternProperties` name: xgrammar drops it there (its `regex`
constraint refuses one), so `"pattern": "^(?!foo).*$"` would let "foobar" through; nor an escaped letter xgrammar
does not know (`\\Z`, `\\A`, `\\h`, `\\R`), which it reads as the letter alone (`literal_escape`, for the `regex`
constraint too). `support.py` asks these of each part of a schema it walks.
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
    let through), or an escape xgrammar reads as its letter alone (`literal_escape`).

    Args:
        schema: one part of a JSON schema (its subschemas are not looked at).
        where: that part's path in the whole schema (`.properties.name`, "" at the root): the answer's starts with it.
    Returns:
        (where, why) of the pattern with a lookahead, or None.
    """
    pattern = schema.get("pattern")
    names = schema.get("patternProperties")
    patterns = [(".pattern", pattern)] if isinstance(pattern, str) else []
    patterns += [(f".patternProperties.{name}", name) for name in (names if isinstance(names, dict) else ())]
    for path, regex in patterns:
        if not isinstance(regex, str):
            continue
        if _has_lookahead(regex):
            return f"{where}{path}", "has a lookahead ((?=...) or (?!...)), which the grammar engine does not enforce"
        escape = literal_escape(regex)
        if escape is not None:
            return f"{where}{path}", unknown_escape_reason(escape)
    return None


# Escaped ASCII letters xgrammar's regex reader does not know: it reads each as the letter alone (with a warning),
# where Python's `re` reads `\A` / `\Z` as anchors (and refuses the others) and PCRE `\h` / `\R` as classes.
# Inside a character class `\k`, `\p`, `\B` and `\P` too. `\U` followed by 8 hex digits is a code point to it.
_LITERAL_ESCAPES = frozenset("ghijlmoqyzACEFGHIJKLMNOQRTUVXYZ")
_LITERAL_IN_CLASS = _LITERAL_ESCAPES | frozenset("kpBP")
_HEX = frozenset("0123456789abcdefABCDEF")


def literal_escape(pattern: str) -> str | None:
    """The first escape in a regex that xgrammar would read as its letter alone (`\\Z`), or None.

    Args:
        pattern: a regex (a `regex` constraint, a schema's `pattern` or `patternProperties` name).
    """
    in_class, index = False, 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\" and index + 1 < len(pattern):
            letter = pattern[index + 1]
            code_point = letter == "U" and len(pattern) >= index + 10 and set(pattern[index + 2 : index + 10]) <= _HEX
            if letter in (_LITERAL_IN_CLASS if in_class else _LITERAL_ESCAPES) and not code_point:
                return "\\" + letter
            index += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        index += 1
    return None


def unknown_escape_reason(escape: str) -> str:
    """Why a pattern holding `escape` (`literal_escape`'s answer) is refused."""
    return (
        f"has the escape {escape}, which the grammar engine does not know and would read as the letter "
        f"{escape[1]!r} alone (escape only what is special: \\d, \\w, \\s, \\n, \\t, \\., ...; no anchors but ^ and $)"
    )


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
