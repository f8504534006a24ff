"""What of a JSON schema the grammar engine (xgrammar) can enforce: a schema using a keyword it would silently
ignore is refused by name, never compiled into a grammar that lets a violating output finish with "stop".

Checked against xgrammar 0.2.8 and 0.2.9 (each refusal was seen to accept a violating instance):
- keywords it ignores: `uniqueItems`, `not`, `contains` (and with it `minContains` / `maxContains`),
  `dependentRequired`, `dependentSchemas` (draft 7's `dependencies`), `if` with `then` or `else`, `$dynamicRef` /
  `$recursiveRef`, references other than JSON pointers (`#/...`), `allOf` with more than one schema, `required`
  naming a property the schema does not declare;
- `multipleOf` but on integers, by a whole number up to 1024, with no bound or with both bounds at most 9,999 apart;
- one keyword decides: of `$ref`, `const`, `enum`, `anyOf`, `oneOf` and `allOf` it enforces the first a schema has and
  nothing beside it, so a second of them, or any other assertion beside one (`type`, `properties`, `required`,
  `maxLength`, ...), is refused; annotations may stand beside (`title`, `description`, `default`, pydantic's
  `discriminator`, ...), and a `type` beside `const` / `enum` that every value has;
- `oneOf` whose branches are not told apart (xgrammar enforces it as `anyOf`): `branches.py`'s `overlap`;
- a lookahead (`(?=...)`, `(?!...)`) in a `pattern` or a `patternProperties` name: xgrammar drops it there (its
  `regex` constraint refuses one), so `"pattern": "^(?!foo).*$"` would let "foobar" through;
- object keywords whose keys may take another schema, or come twice: `objects.py`;
- an empty `anyOf`, `oneOf` or `allOf`: no value matches it (xgrammar let an empty output finish).
Every part is checked, those that references point to included, wherever they are. `then` and `else` without `if`
mean nothing, as in the specification. `format` values it does not know are annotations, as the JSON Schema
specification makes them by default. Nesting deeper than `MAX_SCHEMA_DEPTH` is refused (compile time grows steeply
with depth).
"""

from __future__ import annotations

from typing import Any

from rollout.json_schema.branches import ANNOTATIONS, constant_values, overlap, pointed
from rollout.json_schema.multiples import MAX_MULTIPLE, MAX_MULTIPLE_SPAN, is_number, unenforced_multiple
from rollout.json_schema.objects import unenforced_object_part
from rollout.json_schema.patterns import KNOWN_FORMATS, beside_string_shape, lookahead

# The public names (those of `patterns.py` and `multiples.py` too, as `rollout.schema_support` had them all).
__all__ = ["KNOWN_FORMATS", "MAX_MULTIPLE", "MAX_MULTIPLE_SPAN", "MAX_SCHEMA_DEPTH", "unsupported_schema_part"]

MAX_SCHEMA_DEPTH = 32
# Keywords whose value is a map of names to subschemas / a subschema / a list of subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = (
    "items",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
    "propertyNames",
)
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
# Bounds on a string's length, an array's items and an object's properties: non-negative integers, least first.
_COUNT_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))
_IGNORED = {
    "not": "is not enforced by the grammar engine",
    "maxContains": "is not enforced by the grammar engine",  # named before the contains it goes with
    "minContains": "is not enforced by the grammar engine",
    "contains": "is not enforced by the grammar engine",
    "dependentRequired": "is not enforced by the grammar engine",
    "dependentSchemas": "is not enforced by the grammar engine",
    "dependencies": "is not enforced by the grammar engine",  # draft 7's dependentRequired / dependentSchemas
    "$dynamicRef": "is not supported (use $ref to #/$defs/...)",
    "$recursiveRef": "is not supported (use $ref to #/$defs/...)",
}
# Of these a schema's grammar follows the first it has, and nothing beside it but annotations.
_DECIDING = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_ASSERTIONS = frozenset(
    {
        *_DECIDING,
        *_SCHEMA_MAPS[:2],
        *_SCHEMA_VALUES,
        "prefixItems",
        "type",
        "required",
        "minProperties",
        "maxProperties",
        "minItems",
        "maxItems",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minLength",
        "maxLength",
        "pattern",
        "format",
    }
)
_IS_TYPE = {  # a JSON value (as json.loads gives it) has the type; a bool is an int to Python, never to JSON
    "string": lambda value: isinstance(value, str),
    "integer": lambda value: is_number(value) and (isinstance(value, int) or value.is_integer()),
    "number": lambda value: is_number(value),
    "boolean": lambda value: isinstance(value, bool),
    "null": lambda value: value is None,
    "array": lambda value: isinstance(value, list),
    "object": lambda value: isinstance(value, dict),
}


def unsupported_schema_part(schema: Any) -> tuple[str, str] | None:
    """(where, why) of the first part of `schema` the grammar engine cannot enforce, or None.

    Args:
        schema: a parsed JSON schema (a dict; booleans are subschemas too).
    """
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        return "", f"is nested deeper than {MAX_SCHEMA_DEPTH} levels"
    pending, references, seen = [("", schema)], [], {id(schema)}
    while pending:  # the schema, then each part a reference points to (wherever it is), once however it is spelled
        where, part = pending.pop()
        found = _check(part, where, schema, references)
        if found:
            return found
        for reference in references:
            target = pointed(schema, reference)
            if target is not None and id(target) not in seen:
                seen.add(id(target))
                pending.append(("." + ".".join(reference[2:].split("/")), target))
        references.clear()
    return None


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:  # iterative: a deep document must not exhaust the interpreter's stack
        current, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest
        children = current.values() if isinstance(current, dict) else current if isinstance(current, list) else ()
        stack.extend((child, level + 1) for child in children)
    return deepest


def _check(schema: Any, where: str, root: Any, references: list[str]) -> tuple[str, str] | None:
    """The first unenforceable part of `schema` and its subschemas; the references met are appended."""
    if not isinstance(schema, dict):
        return None
    for keyword, why in _IGNORED.items():
        if keyword in schema:
            return f"{where}.{keyword}", why
    if schema.get("uniqueItems") is True:
        return f"{where}.uniqueItems", "is not enforced by the grammar engine"
    if "if" in schema and ("then" in schema or "else" in schema):
        return f"{where}.if", "(with then / else) is not enforced by the grammar engine"
    found = (
        _beside_deciding(schema, where)
        or beside_string_shape(schema, where)
        or _bad_count(schema, where)
        or lookahead(schema, where)
        or unenforced_object_part(schema, where)
    )
    if found:
        return found
    if "multipleOf" in schema:
        why = unenforced_multiple(schema)
        if why:
            return f"{where}.multipleOf", why
    reference = schema.get("$ref")
    if reference is not None:
        if not (isinstance(reference, str) and (reference == "#" or reference.startswith("#/"))):
            return f"{where}.$ref", f"only JSON-pointer references (#/...) are supported, got {reference!r}"
        references.append(reference)
    for keyword in ("anyOf", "oneOf", "allOf"):
        if schema.get(keyword) == []:
            return f"{where}.{keyword}", "is empty: no value can match it"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"{where}.allOf", "with more than one schema is not enforced by the grammar engine (merge them)"
    required, declared = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        names = declared if isinstance(declared, dict) else {}
        missing = [name for name in required if not isinstance(name, str) or name not in names]
        if missing:
            return (
                f"{where}.required",
                f"names {missing[0]!r}, which is not in properties (the engine cannot require it)",
            )
    one_of = schema.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1:
        why = overlap(one_of, root)
        if why:
            return f"{where}.oneOf", why
    return _check_children(schema, where, root, references)


def _bad_count(schema: dict, where: str) -> tuple[str, str] | None:
    """A length or count bound that is not a non-negative integer (JSON Schema's meta-schema refuses it; xgrammar would
    make strings for `maxLength: -1`, which no string meets), or a least bound above its most: no value meets both."""
    for low, high in _COUNT_BOUNDS:
        for keyword in (low, high):
            value = schema.get(keyword)
            if keyword in schema and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                return f"{where}.{keyword}", f"must be a non-negative integer, got {value!r}"
        if low in schema and high in schema and schema[low] > schema[high]:
            return f"{where}.{low}", f"{schema[low]} is above {high} {schema[high]}: no value meets both"
    return _items_cut(schema, where)


def _items_cut(schema: dict, where: str) -> tuple[str, str] | None:
    """A count bound of an array without `items` where JSON Schema allows an item past prefixItems: xgrammar's strict
    mode, which enforces `additionalProperties: false` by default, reads the absent `items` beside minItems or
    maxItems, or beside prefixItems alone, as "no item past prefixItems" (it refused `minItems: 2`; `maxItems: 3` let
    the model write `[]` alone; a lone prefixItems of one let it write one item at most). A bare array takes any."""
    kind, prefix = schema.get("type"), schema.get("prefixItems")
    array = (
        kind == "array" or (isinstance(kind, list) and "array" in kind) or (kind is None and "prefixItems" in schema)
    )
    prefix = prefix if isinstance(prefix, list) else []
    if not array or "items" in schema or schema.get("maxItems", len(prefix) + 1) <= len(prefix):
        return None
    keyword = "minItems" if schema.get("minItems", 0) > len(prefix) or "maxItems" not in schema else "maxItems"
    if keyword not in schema:  # no bound: prefixItems alone cut too (the tuple's length is its most)
        if not prefix:
            return None
        keyword, reason = "prefixItems", f"of {len(prefix)} without `items` or maxItems: the grammar engine reads that"
        return f"{where}.{keyword}", (
            f'{reason} as no item allowed past them; add "items": {{}} (any item), the items\' schema, or "maxItems": '
            f"{len(prefix)} (the tuple alone)"
        )
    reason = f"{schema[keyword]} without `items`: the grammar engine reads that as no item allowed"
    return f"{where}.{keyword}", f'{reason} past prefixItems; add "items": {{}} (any item) or the items\' schema'


def _beside_deciding(schema: dict, where: str) -> tuple[str, str] | None:
    """A second deciding keyword, or an assertion, beside the one xgrammar follows (a `type` every constant has may
    stand beside `const` / `enum`)."""
    deciding = [keyword for keyword in _DECIDING if keyword in schema]
    if not deciding:
        return None
    first = deciding[0]
    for keyword in schema:
        if keyword == first or keyword in ANNOTATIONS or keyword not in _ASSERTIONS:
            continue
        if first in ("const", "enum") and _every_value_meets(schema, keyword):
            continue
        return f"{where}.{keyword}", f"beside {first} is not enforced by the grammar engine (it follows {first} alone)"
    return None


def _every_value_meets(schema: dict, keyword: str) -> bool:
    """Whether every `const` / `enum` value meets `keyword` beside it (what xgrammar enforces is then the same); a
    `format` there is an annotation of the values (OpenAPI's int32)."""
    if keyword == "format":
        return True
    values, bound = constant_values(schema), schema[keyword]
    if keyword == "type":
        kinds = [bound] if isinstance(bound, str) else bound if isinstance(bound, list) else []
        checks = [_IS_TYPE[name] for name in kinds if isinstance(name, str) and name in _IS_TYPE]
        return bool(checks) and all(any(check(value) for check in checks) for value in values)
    meets = _VALUE_CHECKS.get(keyword)
    if meets is None or not is_number(bound):  # a pattern is not run here: a regex can take exponential time
        return False
    try:
        return all(meets(value, bound) for value in values)
    except (OverflowError, ValueError):
        return False


# keyword -> whether a value meets it (a value of another type does: JSON Schema's keywords apply to their own)
_VALUE_CHECKS = {
    "minLength": lambda value, bound: not isinstance(value, str) or len(value) >= bound,
    "maxLength": lambda value, bound: not isinstance(value, str) or len(value) <= bound,
    "minimum": lambda value, bound: not is_number(value) or value >= bound,
    "maximum": lambda value, bound: not is_number(value) or value <= bound,
    "exclusiveMinimum": lambda value, bound: not is_number(value) or value > bound,
    "exclusiveMaximum": lambda value, bound: not is_number(value) or value < bound,
    "multipleOf": lambda value, bound: not is_number(value) or bound > 0 and (value / bound).is_integer(),
}


def _check_children(schema: dict, where: str, root: Any, references: list[str]) -> tuple[str, str] | None:
    for keyword in _SCHEMA_MAPS:
        children = schema.get(keyword)
        if isinstance(children, dict):
            for name, child in children.items():
                found = _check(child, f"{where}.{keyword}.{name}", root, references)
                if found:
                    return found
    for keyword in _SCHEMA_VALUES:
        found = _check(schema.get(keyword), f"{where}.{keyword}", root, references)
        if found:
            return found
    for keyword in (*_SCHEMA_LISTS, "items"):
        children = schema.get(keyword)
        if isinstance(children, list):
            for index, child in enumerate(children):
                found = _check(child, f"{where}.{keyword}[{index}]", root, references)
                if found:
                    return found
    return None
