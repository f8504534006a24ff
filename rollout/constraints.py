"""Structured-output constraints of a request (`SamplingParams.regex`, `json`, `choice`, `grammar`, `json_object`,
named as vLLM's `StructuredOutputsParams`): their validation, free of torch and of the grammar engine. The engine
compiles them (`rollout.engine.grammar.constraints`)."""

from __future__ import annotations

import json
from typing import Any

from rollout.json_schema.patterns import literal_escape, unknown_escape_reason
from rollout.json_schema.support import unsupported_schema_part
from rollout.validation import FieldError

CONSTRAINT_FIELDS = ("regex", "json", "choice", "grammar", "json_object")
MAX_SPEC_CHARS = 1 << 16  # a spec longer than this is refused (compiling it could take the engine's time)
MAX_CHOICES = 256


def is_set(name: str, value: Any) -> bool:
    """Whether constraint field `name` holds a constraint (`json_object` when true; the others when not None)."""
    return value is not False if name == "json_object" else value is not None


def normalized_constraint(fields: dict[str, Any]) -> dict[str, Any]:
    """The constraint fields of a SamplingParams, checked and in canonical form: `json` as a JSON string (a dict is
    dumped in its own key order: the grammar writes an object's properties in the order the schema declares them, as
    vLLM and OpenAI do, so sorting them would reorder the output), `choice` as a tuple of strings.

    Args:
        fields: the five fields by name (None, and False for `json_object`, when not set).
    Raises:
        FieldError: several set at once (naming them), one malformed (naming it), or a JSON schema using what the
            grammar engine cannot enforce (`rollout.json_schema`).
    """
    given = [name for name in CONSTRAINT_FIELDS if is_set(name, fields[name])]
    if len(given) > 1:
        raise FieldError(given[1], f"structured-output constraints are exclusive, got {given}")
    out = dict(fields)
    if not isinstance(out["json_object"], bool):
        raise FieldError("json_object", f"must be true or false, got {out['json_object']!r}")
    for name in ("regex", "grammar"):
        value = out[name]
        if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_SPEC_CHARS):
            raise FieldError(name, f"must be a non-empty string of at most {MAX_SPEC_CHARS} characters")
    escape = literal_escape(out["regex"]) if out["regex"] is not None else None
    if escape is not None:
        raise FieldError("regex", unknown_escape_reason(escape))
    if out["json"] is not None:
        out["json"] = _schema_text(out["json"])
    choice = out["choice"]
    if choice is not None:
        if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not 0 < len(choice) <= MAX_CHOICES:
            raise FieldError("choice", f"must be a list of 1 to {MAX_CHOICES} strings")
        if not all(isinstance(c, str) and c for c in choice):
            raise FieldError("choice", "every choice must be a non-empty string")
        if sum(len(c) for c in choice) > MAX_SPEC_CHARS:
            raise FieldError("choice", f"the choices are longer than {MAX_SPEC_CHARS} characters in all")
        out["choice"] = tuple(choice)
    return out


def _text_fits(value: Any, limit: int) -> bool:
    """Whether a decoded JSON value's text may be at most `limit` characters: each node counts at least one, each
    string and key its length. Stops at the first count past `limit`, so its work is bounded by `limit` whatever
    the value's size (a map of a million keys is refused unread)."""
    left, stack = limit, [value]
    while stack and left >= 0:
        node = stack.pop()
        left -= 1
        if isinstance(node, dict):
            if len(node) > left:
                return False
            for key, item in node.items():
                left -= len(key) if isinstance(key, str) else 1
                stack.append(item)
        elif isinstance(node, list):
            if len(node) > left:
                return False
            stack.extend(node)
        elif isinstance(node, str):
            left -= len(node)
    return left >= 0


def _schema_text(schema: Any) -> str:
    """A JSON schema (a dict or its text) as canonical text, checked: JSON, an object, enforceable."""
    if isinstance(schema, dict) and not _text_fits(schema, MAX_SPEC_CHARS):  # refused before it is written out
        raise FieldError("json", f"the schema's JSON text is longer than {MAX_SPEC_CHARS} characters")
    try:
        if isinstance(schema, dict):
            schema = json.dumps(schema, allow_nan=False)  # never sort_keys: property order is the output's
        too_long = isinstance(schema, str) and len(schema) > MAX_SPEC_CHARS  # (a dict's count above is a lower bound)
        parsed = json.loads(schema) if isinstance(schema, str) and schema and not too_long else None
    except (ValueError, TypeError, RecursionError) as error:  # bytes or NaN in a dict, bad text, deep nesting
        reason = "is too deeply nested" if isinstance(error, RecursionError) else f"is not valid JSON: {error}"
        raise FieldError("json", reason) from None
    if too_long:
        raise FieldError("json", f"the schema's JSON text is longer than {MAX_SPEC_CHARS} characters")
    if parsed is None:
        raise FieldError("json", f"must be a JSON schema (an object, or its JSON text up to {MAX_SPEC_CHARS})")
    if not isinstance(parsed, dict):
        raise FieldError("json", f"a JSON schema is an object, got {type(parsed).__name__}")
    unsupported = unsupported_schema_part(parsed)
    if unsupported is not None:
        where, why = unsupported
        raise FieldError("json", f"schema{where} {why}")
    return schema


def constraint_of(sampling: Any) -> tuple[str, Any] | None:
    """(field name, spec) of a SamplingParams' constraint, or None when it has none."""
    for name in CONSTRAINT_FIELDS:
        value = getattr(sampling, name)
        if is_set(name, value):
            return name, value
    return None
