"""Structured outputs over HTTP: OpenAI's `response_format` and vLLM's `structured_outputs` request field -> the
constraint fields of `SamplingParams` (`regex`, `json`, `choice`, `grammar`, `json_object`).

- `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object), or
  `{"type": "json_schema", "json_schema": {"name", "schema", "description"?, "strict"?}}` (the schema).
- `structured_outputs`: `{"regex" | "json" | "choice" | "grammar" | "json_object": ...}`, exactly one of them, as
  vLLM's `StructuredOutputsParams`; `disable_fallback` is accepted with no effect (rollout has one grammar engine and
  never falls back); vLLM's other options are refused by name.

Errors name the client's field (`response_format.json_schema.schema`, `structured_outputs.regex`), including those
the grammar engine raises when a spec does not compile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout.constraints import CONSTRAINT_FIELDS, is_set
from rollout.service.http.errors import bad_field

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = {"name", "schema", "description", "strict"}
NO_EFFECT_OPTIONS = {"disable_fallback"}
# vLLM's StructuredOutputsParams options rollout does not serve, and why (refused by name, never ignored).
REFUSED_OPTIONS = {
    "disable_any_whitespace": "is not supported (JSON may contain any whitespace)",
    "disable_additional_properties": "is not supported (the schema's own additionalProperties applies)",
    "whitespace_pattern": "is not supported",
    "structural_tag": "is not supported",
}
# vLLM's older request fields, replaced by `structured_outputs`: refused with the way to say it now.
LEGACY_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
}


@dataclass
class StructuredRequest:
    """A body's constraint, ready for SamplingParams.

    Attributes:
        fields: the SamplingParams constraint field and its spec ({} when the body asks for none).
        param: the client's name for that field (what an error names).
    """

    fields: dict[str, Any] = field(default_factory=dict)
    param: str | None = None


def structured_request(body: dict[str, Any]) -> StructuredRequest:
    """The constraint a body asks for through `response_format` or `structured_outputs` (at most one of them).

    Args:
        body: the request body (its fields already checked as known to the endpoint).
    Raises:
        APIError: a malformed field, a legacy `guided_*` field, or both fields set (400 naming the field).
    """
    refuse_legacy_fields(body)
    from_format = _response_format(body.get("response_format"))
    from_vllm = _structured_outputs(body.get("structured_outputs"))
    if from_format.fields and from_vllm.fields:
        raise bad_field("structured_outputs", "give response_format or structured_outputs, not both")
    return from_format if from_format.fields else from_vllm


def refuse_legacy_fields(body: dict[str, Any]) -> None:
    """Refuse vLLM's older `guided_*` fields with the `structured_outputs` key to send instead (a 400 naming it)."""
    for name, replacement in LEGACY_FIELDS.items():
        if name in body:
            hint = f"structured_outputs={{'{replacement}': ...}}" if replacement else "structured_outputs"
            raise bad_field(name, f"vLLM's older field is not taken; send {hint} (vLLM's current field)")


def _response_format(value: Any) -> StructuredRequest:
    if value is None:
        return StructuredRequest()
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMAT_TYPES:
        raise bad_field("response_format", f"must be an object whose type is one of {list(RESPONSE_FORMAT_TYPES)}")
    kind = value["type"]
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise bad_field(f"response_format.{unknown[0]}", f"unknown field for type {kind!r}")
    if kind == "text":
        return StructuredRequest()
    if kind == "json_object":
        return StructuredRequest({"json_object": True}, "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_field("response_format.json_schema", "must be an object with a name and a schema")
    unknown = sorted(set(spec) - JSON_SCHEMA_KEYS)
    if unknown:
        raise bad_field(
            f"response_format.json_schema.{unknown[0]}", f"unknown field (known: {sorted(JSON_SCHEMA_KEYS)})"
        )
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_field("response_format.json_schema.name", "must be a non-empty string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_field("response_format.json_schema.strict", "must be a boolean")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise bad_field("response_format.json_schema.description", "must be a string")
    if spec.get("schema") is None:
        raise bad_field("response_format.json_schema.schema", "is required: the JSON schema the output follows")
    return StructuredRequest({"json": spec["schema"]}, "response_format.json_schema.schema")


def _structured_outputs(value: Any) -> StructuredRequest:
    if value is None:
        return StructuredRequest()
    if not isinstance(value, dict):
        raise bad_field("structured_outputs", f"must be an object with one of {list(CONSTRAINT_FIELDS)}")
    for name, why in REFUSED_OPTIONS.items():
        if value.get(name) is not None and value.get(name) is not False:
            raise bad_field(f"structured_outputs.{name}", why)
    known = set(CONSTRAINT_FIELDS) | NO_EFFECT_OPTIONS | set(REFUSED_OPTIONS)
    unknown = sorted(set(value) - known)
    if unknown:
        raise bad_field(f"structured_outputs.{unknown[0]}", f"unknown field (known: {sorted(known)})")
    if value.get("disable_fallback") is not None and not isinstance(value["disable_fallback"], bool):
        raise bad_field("structured_outputs.disable_fallback", "must be a boolean")
    given = [name for name in CONSTRAINT_FIELDS if value.get(name) is not None and is_set(name, value[name])]
    if not given:
        raise bad_field("structured_outputs", f"needs one of {list(CONSTRAINT_FIELDS)}")
    if len(given) > 1:
        raise bad_field(f"structured_outputs.{given[1]}", f"constraints are exclusive, got {given}")
    return StructuredRequest({given[0]: value[given[0]]}, f"structured_outputs.{given[0]}")


def client_param(request: StructuredRequest, engine_field: str) -> str | None:
    """The client's name for a constraint field an engine error names (None: not a constraint field)."""
    if engine_field not in CONSTRAINT_FIELDS:
        return None
    return request.param or engine_field
