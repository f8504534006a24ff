"""Structured-output constraints of a request (`SamplingParams.regex`, `json`, `choice`, `grammar`, `json_object`,
named as vLLM's `StructuredOutputsParams`): their validation, free of torch and of the grammar engine. The engine
compiles them (`rollout.engine.grammar`)."""

from __future__ import annotations

import json
from typing import Any

from rollout.validation import FieldError

CONSTRAINT_FIELDS = ("regex", "json", "choice", "grammar", "json_object")
MAX_SPEC_CHARS = 1 << 16  # a spec longer than this is refused (compiling it could take the engine's time)
MAX_CHOICES = 256


def normalized_constraint(fields: dict[str, Any]) -> dict[str, Any]:
    """The constraint fields of a SamplingParams, checked and in canonical form: `json` as a JSON string (a dict is
    dumped with sorted keys, so equal schemas share a compiled grammar), `choice` as a tuple of strings.

    Args:
        fields: the five fields by name (None / False when not set).
    Raises:
        FieldError: several set at once (naming them), or one malformed (naming it).
    """
    given = [name for name in CONSTRAINT_FIELDS if fields[name] not in (None, False)]
    if len(given) > 1:
        raise FieldError(given[1], f"structured-output constraints are exclusive, got {given}")
    out = dict(fields)
    if out["json_object"] not in (False, True):
        raise FieldError("json_object", f"must be true or false, got {out['json_object']!r}")
    for name in ("regex", "grammar"):
        value = out[name]
        if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_SPEC_CHARS):
            raise FieldError(name, f"must be a non-empty string of at most {MAX_SPEC_CHARS} characters")
    schema = out["json"]
    if schema is not None:
        if isinstance(schema, dict):
            schema = json.dumps(schema, sort_keys=True)
        if not isinstance(schema, str) or not schema or len(schema) > MAX_SPEC_CHARS:
            raise FieldError("json", f"must be a JSON schema (an object, or its JSON text up to {MAX_SPEC_CHARS})")
        try:
            parsed = json.loads(schema)
        except ValueError as error:
            raise FieldError("json", f"is not valid JSON: {error}") from None
        if not isinstance(parsed, (dict, bool)):
            raise FieldError("json", f"a JSON schema is an object (or true/false), got {type(parsed).__name__}")
        out["json"] = schema
    choice = out["choice"]
    if choice is not None:
        if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not 0 < len(choice) <= MAX_CHOICES:
            raise FieldError("choice", f"must be a list of 1 to {MAX_CHOICES} strings")
        if not all(isinstance(c, str) and c for c in choice):
            raise FieldError("choice", "every choice must be a non-empty string")
        out["choice"] = tuple(choice)
    return out


def constraint_of(sampling: Any) -> tuple[str, Any] | None:
    """(field name, spec) of a SamplingParams' constraint, or None when it has none."""
    for name in CONSTRAINT_FIELDS:
        value = getattr(sampling, name)
        if value not in (None, False):
            return name, value
    return None
