"""References and `oneOf` branches in a JSON schema, as the grammar engine (xgrammar) reads them: where a `$ref`
points, and whether a `oneOf`'s branches are told apart (xgrammar enforces `oneOf` as `anyOf`, which is the same only
when no instance can match two branches). `support.py` decides with these what it refuses.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

MAX_HOPS = 32  # references followed in a row (a longer chain, or a cycle, is left as it is)
MAX_PAIRWISE = 64  # branches compared pair by pair (beyond, only a property telling all of them apart counts)
MAX_VISITS = 4096  # branches looked at while nested ones are flattened
# Keywords that change nothing an instance may be: beside a reference or a combinator they are no assertion.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "$comment",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "discriminator",  # OpenAPI's (pydantic writes it): which property tells branches apart; their consts enforce it
        "$id",
        "$schema",
        "$anchor",
        "$defs",
        "definitions",
    }
)
_KINDS = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}


def pointed(root: Any, reference: str) -> Any:
    """The value a JSON-pointer reference (`#`, `#/$defs/Name`, RFC 6901 escapes) points to in `root`, or None.

    Args:
        root: the whole schema.
        reference: the `$ref` value.
    """
    if reference == "#":
        return root
    if not reference.startswith("#/"):
        return None
    value = root
    for part in reference[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif (
            isinstance(value, list) and part.isascii() and part.isdigit() and len(part) < 10 and int(part) < len(value)
        ):
            value = value[int(part)]
        else:
            return None
    return value


def resolved(schema: Any, root: Any) -> Any:
    """The schema a subschema that is only a reference (annotations beside) points to, after every such hop; anything
    else as it is (a reference that points nowhere is the grammar engine's compiler's to report)."""
    for _ in range(MAX_HOPS):
        reference = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(reference, str) or set(schema) - ANNOTATIONS - {"$ref"}:
            return schema
        target = pointed(root, reference)
        if target is None:
            return schema
        schema = target
    return schema


def overlap(branches: list, root: Any) -> str | None:
    """Why an instance could match two of a `oneOf`'s branches, or None when none can: they differ by type, by
    constant, or by a property each requires whose constants differ. References are followed, and a branch that
    is itself a `oneOf` / `anyOf` (pydantic's nested discriminated unions) counts as its own branches.

    Args:
        branches: the `oneOf` list.
        root: the whole schema (where references point).
    """
    leaves = _leaves(branches, root, MAX_HOPS, [MAX_VISITS])
    if leaves is None:
        return f"branches nest too deeply, or are too many (over {MAX_VISITS} with the nested ones), to be told apart"
    if _by_one_property(leaves, root):
        return None
    if len(leaves) > MAX_PAIRWISE:
        return f"branches must be told apart by one property they all require (more than {MAX_PAIRWISE} branches)"
    unrequired = None
    for index, first in enumerate(leaves):
        for second in leaves[index + 1 :]:
            apart, name = _apart(first, second, root)
            if not apart:
                unrequired = unrequired or name
                if name is None:
                    return "branches must differ by type or by a discriminator property's const (else it is enforced as anyOf)"
    if unrequired is not None:
        return f"branches differ by {unrequired!r}, which one of each two must require (an instance without it matches both)"
    return None


def _leaves(branches: list, root: Any, depth: int, budget: list[int]) -> list | None:
    """The branches with references followed and nested `oneOf` / `anyOf` branches flattened (None: too deep, or
    past the budget of branches visited: references can make a short schema's tree exponentially large)."""
    if depth == 0:
        return None
    leaves = []
    for branch in branches:
        budget[0] -= 1
        if budget[0] < 0:
            return None
        branch = resolved(branch, root)
        nested = _only_combinator(branch)
        if nested is None:
            leaves.append(branch)
            continue
        inner = _leaves(nested, root, depth - 1, budget)
        if inner is None:
            return None
        leaves.extend(inner)
    return leaves


def _only_combinator(schema: Any) -> list | None:
    """The branches of a schema that is a `oneOf` or an `anyOf` and nothing else (annotations aside), or None."""
    if not isinstance(schema, dict):
        return None
    for keyword in ("oneOf", "anyOf"):
        branches = schema.get(keyword)
        if isinstance(branches, list) and not set(schema) - ANNOTATIONS - {keyword}:
            return branches
    return None


def _by_one_property(leaves: list, root: Any) -> bool:
    """Whether all branches differ by type, or, all of them objects only, one property each requires has a
    different constant in each."""
    kinds = [_kinds(leaf) for leaf in leaves]
    if all(kinds) and sum(map(len, kinds)) == len(set().union(*kinds)):
        return True
    if not all(isinstance(leaf, dict) and isinstance(leaf.get("properties"), dict) for leaf in leaves):
        return False
    if any(_object_kinds(leaf) != {"object"} for leaf in leaves):
        return False
    for name in set.intersection(*(set(leaf["properties"]) for leaf in leaves)):
        values = [constants(resolved(leaf["properties"][name], root)) for leaf in leaves]
        if all(name in _required(leaf) for leaf in leaves) and all(values):
            if sum(map(len, values)) == len(set().union(*values)):
                return True
    return False


def _apart(first: Any, second: Any, root: Any) -> tuple[bool, str | None]:
    """(whether no instance matches both branches, a property whose constants differ but that one of them does not
    require)."""
    kinds = _kinds(first), _kinds(second)
    if all(kinds) and not kinds[0] & kinds[1]:
        return True, None
    values = constants(first), constants(second)
    if all(values) and not values[0] & values[1]:
        return True, None
    properties = [leaf.get("properties") if isinstance(leaf, dict) else None for leaf in (first, second)]
    if not all(isinstance(value, dict) for value in properties):
        return False, None
    # Properties tell objects apart only: a kind beside "object" one branch allows and the other too (null) overlaps.
    one, other = _object_kinds(first), _object_kinds(second)
    if (one - {"object"}) & other or (other - {"object"}) & one:
        return False, None
    unrequired = None
    for name in set(properties[0]) & set(properties[1]):
        values = constants(resolved(properties[0][name], root)), constants(resolved(properties[1][name], root))
        if all(values) and not values[0] & values[1]:
            if name in _required(first) or name in _required(second):  # without it, it matches that one no more
                return True, None
            unrequired = name
    return False, unrequired


def _object_kinds(schema: dict) -> set[str]:
    """A branch's kinds, where one without a `type` but with `properties` counts as an object (as xgrammar reads it)."""
    return _kinds(schema) or {"object"}


def _required(schema: dict) -> set:
    required = schema.get("required")
    return {name for name in required if isinstance(name, str)} if isinstance(required, list) else set()


def _kinds(schema: Any) -> set[str]:
    """The JSON types a schema's instances may have, when it says (an integer is a number too), else empty."""
    if not isinstance(schema, dict):
        return set()
    values = constant_values(schema)
    if values:
        return {_KINDS.get(type(value), "null") for value in values}
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    if not all(isinstance(name, str) for name in kinds):
        return set()
    return {"number" if name == "integer" else name for name in kinds}


def constant_values(schema: Any) -> list:
    """The values a schema's `const` / `enum` allows (empty when it has neither)."""
    if not isinstance(schema, dict):
        return []
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    return values if isinstance(values, list) else []


def constants(schema: Any) -> set[str]:
    """`constant_values` as canonical JSON texts (1 and 1.0 are one value; object keys sorted)."""
    return {json.dumps(_canonical(value), sort_keys=True) for value in constant_values(schema)}


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    if isinstance(value, dict):
        return {key: _canonical(item) for key, item in value.items()}
    return value
