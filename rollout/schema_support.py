"""What of a JSON schema the grammar engine (xgrammar) can enforce: a schema using a keyword it would silently
ignore is refused by name, never compiled into a grammar that lets a violating output finish with "stop".

Checked against xgrammar 0.2.8 (each refusal was seen to accept a violating instance): `uniqueItems`, `not`,
`contains` (and with it `minContains` / `maxContains`), `dependentRequired`, `dependentSchemas` (draft 7's
`dependencies`), `if` with `then` or `else`, `multipleOf` but on integers by a whole number up to 1024, `$dynamicRef` / `$recursiveRef`, references other than JSON
pointers (`#/...`), `allOf` with more than one schema, `required` naming a property the schema does not declare, and
`oneOf` whose branches are not told apart by their types or by a discriminator (a property whose `const` / `enum`
values differ: xgrammar then enforces `anyOf`); a branch that is a reference (pydantic's discriminated unions) is
told apart by the schema it points to. `then` and `else` without `if` mean nothing, as in the specification. `format` values it does not know are annotations, as the JSON Schema specification makes them by default.
Nesting deeper than `MAX_SCHEMA_DEPTH` is refused (compile time grows steeply with depth).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

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
# Keywords beside a `$ref` that change nothing an instance may be (a branch with only these is its target).
_REFERENCE_KEYS = {
    "$ref",
    "title",
    "description",
    "$comment",
    "default",
    "examples",
    "deprecated",
    "readOnly",
    "writeOnly",
}
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


def unsupported_schema_part(schema: Any) -> tuple[str, str] | None:
    """(where, why) of the first part of `schema` the grammar engine cannot enforce, or None.

    Args:
        schema: a parsed JSON schema (a dict; booleans are subschemas too).
    """
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        return "", f"is nested deeper than {MAX_SCHEMA_DEPTH} levels"
    return _check(schema, "", schema)


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


def _check(schema: Any, where: str, root: Any) -> tuple[str, str] | None:
    if not isinstance(schema, dict):
        return None
    for keyword, why in _IGNORED.items():
        if keyword in schema:
            return f"{where}.{keyword}", why
    if schema.get("uniqueItems") is True:
        return f"{where}.uniqueItems", "is not enforced by the grammar engine"
    if "if" in schema and ("then" in schema or "else" in schema):
        return f"{where}.if", "(with then / else) is not enforced by the grammar engine"
    if "multipleOf" in schema and not _enforced_multiple(schema):
        reason = "is enforced by the grammar engine only on integers, by a whole number from 1 to 1024"
        return f"{where}.multipleOf", reason
    reference = schema.get("$ref")
    if reference is not None and not (isinstance(reference, str) and (reference == "#" or reference.startswith("#/"))):
        return f"{where}.$ref", f"only JSON-pointer references (#/...) are supported, got {reference!r}"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"{where}.allOf", "with more than one schema is not enforced by the grammar engine (merge them)"
    required, declared = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        names = declared if isinstance(declared, dict) else {}
        missing = [name for name in required if name not in names]
        if missing:
            return (
                f"{where}.required",
                f"names {missing[0]!r}, which is not in properties (the engine cannot require it)",
            )
    one_of = schema.get("oneOf")
    if (
        isinstance(one_of, list)
        and len(one_of) > 1
        and not _disjoint([_resolved(branch, root) for branch in one_of], root)
    ):
        reason = "branches must differ by type or by a discriminator property's const (else it is enforced as anyOf)"
        return f"{where}.oneOf", reason
    return _check_children(schema, where, root)


def _check_children(schema: dict, where: str, root: Any) -> tuple[str, str] | None:
    for keyword in _SCHEMA_MAPS:
        children = schema.get(keyword)
        if isinstance(children, dict):
            for name, child in children.items():
                found = _check(child, f"{where}.{keyword}.{name}", root)
                if found:
                    return found
    for keyword in _SCHEMA_VALUES:
        found = _check(schema.get(keyword), f"{where}.{keyword}", root)
        if found:
            return found
    for keyword in (*_SCHEMA_LISTS, "items"):
        children = schema.get(keyword)
        if isinstance(children, list):
            for index, child in enumerate(children):
                found = _check(child, f"{where}.{keyword}[{index}]", root)
                if found:
                    return found
    return None


def _enforced_multiple(schema: dict) -> bool:
    """Whether xgrammar enforces the schema's `multipleOf`: on a type of integers (null allowed beside), by a whole
    number in [1, 1024] (beyond, and on numbers, it logs that it ignores it)."""
    kinds = schema.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    multiple = schema["multipleOf"]
    whole = isinstance(multiple, (int, float)) and not isinstance(multiple, bool) and float(multiple).is_integer()
    return "integer" in kinds and kinds <= {"integer", "null"} and whole and 1 <= multiple <= 1024


def _disjoint(branches: list, root: Any) -> bool:
    """Whether no instance can match two branches: each has its own types, or a shared property's constants differ
    (`branches` with their references followed; a property's schema may be one too)."""
    types = [_types(branch) for branch in branches]
    if all(types) and sum(len(t) for t in types) == len(set().union(*types)):
        return True
    if not all(isinstance(branch, dict) and isinstance(branch.get("properties"), dict) for branch in branches):
        return False
    shared = set.intersection(*(set(branch["properties"]) for branch in branches))
    for name in shared:
        values = [_constants(_resolved(branch["properties"][name], root)) for branch in branches]
        required = all(name in (branch.get("required") or ()) for branch in branches)
        if required and all(values) and sum(len(v) for v in values) == len(set().union(*values)):
            return True
    return False


def _resolved(schema: Any, root: Any) -> Any:
    """The schema a subschema that is only a reference (`{"$ref": "#/..."}`, annotations beside) points to, after
    every such hop; anything else as it is (a reference beside other keywords, or one that points nowhere, which the
    grammar engine's compiler reports)."""
    for _ in range(MAX_SCHEMA_DEPTH):  # a reference chain longer than this, or a cycle, is left as it is
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)) or set(schema) - _REFERENCE_KEYS:
            return schema
        target = _pointed(root, schema["$ref"])
        if target is None:
            return schema
        schema = target
    return schema


def _pointed(root: Any, reference: str) -> Any:
    """The value a JSON-pointer reference (`#`, `#/$defs/Name`, RFC 6901 escapes) points to in `root`, or None."""
    if reference == "#":
        return root
    if not reference.startswith("#/"):
        return None
    value = root
    for part in reference[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def _types(branch: Any) -> set[str]:
    kind = branch.get("type") if isinstance(branch, dict) else None
    if isinstance(kind, str):
        return {"number" if kind == "integer" else kind}  # an integer is also a number
    return set()


def _constants(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    if "const" in schema:
        return {repr(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {repr(value) for value in schema["enum"]}
    return set()
