"""`--batch-config KEY=VALUE ...`: `ContinuousBatchingConfig` fields from the command line, each value read as its
field's type, each key and value checked by the config itself (a bad one is a `FieldError` naming it)."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from rollout.config import SPECULATIVE_SETTINGS, ContinuousBatchingConfig, FieldError

# Fields no command line can express (a transformers CompileConfig object).
NOT_FROM_COMMAND_LINE = ("decode_compile_config",)
_BOOLEANS = {"true": True, "on": True, "yes": True, "1": True, "false": False, "off": False, "no": False, "0": False}


def batch_config_from_pairs(pairs: list[str], **defaults: Any) -> ContinuousBatchingConfig:
    """A `ContinuousBatchingConfig` from "KEY=VALUE" strings over `defaults`.

    Values are read by the field's annotation: "none" is None where the field allows it; booleans take
    true/false/on/off/yes/no/1/0; numbers as written.

    Args:
        pairs: the strings, e.g. ["num_blocks=512", "scheduler_type=prefill_first"].
        **defaults: field values used unless a pair sets them.
    Raises:
        FieldError: a malformed pair, an unknown key (the message lists the known ones), a value that does not read
            as its field's type, one the config refuses, or a speculative setting without `speculative`.
    """
    fields = {field.name: str(field.type) for field in dataclasses.fields(ContinuousBatchingConfig)}
    values, given = dict(defaults), set()
    for pair in pairs:
        key, equals, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not equals or not key:
            raise FieldError(pair, "expected KEY=VALUE, e.g. num_blocks=512")
        if key not in fields or key in NOT_FROM_COMMAND_LINE:
            settable = [name for name in fields if name not in NOT_FROM_COMMAND_LINE]
            close = difflib.get_close_matches(key, settable, n=1)
            guess = f"did you mean {close[0]}? " if close else ""
            raise FieldError(
                key, f"is not a ContinuousBatchingConfig field settable here; {guess}those are: {', '.join(settable)}"
            )
        if key in given:
            raise FieldError(key, "is given twice; give each field once")
        given.add(key)
        values[key] = _read(key, text.strip(), fields[key])
    if None not in (values.get("num_blocks"), values.get("max_memory_percent")):  # the percent would size nothing
        raise FieldError("max_memory_percent", "has no effect with num_blocks (which sizes the KV cache itself)")
    for key in SPECULATIVE_SETTINGS:  # typed to take effect: told it would not (before the config warns of it)
        if key in given and values.get("speculative") is None:
            raise FieldError(key, "has no effect without speculative (speculative=suffix turns it on)")
    return ContinuousBatchingConfig(**values)


def _read(key: str, text: str, annotation: str) -> Any:
    """`text` as a value of a field annotated `annotation` (annotations are strings here: postponed evaluation)."""
    if text.lower() == "none" and "None" in annotation:
        return None
    if annotation.startswith("bool"):
        if text.lower() not in _BOOLEANS:
            raise FieldError(key, f"expected true or false, got {text!r}")
        return _BOOLEANS[text.lower()]
    for kind in (int, float):
        if annotation.startswith(kind.__name__):
            try:
                return kind(text)
            except ValueError:
                raise FieldError(key, f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    return text
