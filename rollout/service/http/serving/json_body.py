"""A request body's bytes parsed as JSON (`parse_json`): fast on every kind of value, exact on integers past 64 bits,
and refusing a key given twice in one object (JSON parsers keep the last value silently: `{"max_tokens": 3,
"max_tokens": 9}` would ask for 9)."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import orjson

from rollout.service.http.errors import APIError
from rollout.validation import lone_surrogate

# Bodies over this size are parsed one at a time on their own thread (smaller ones parse in well under 0.1 s).
BIG_BODY_BYTES = 1 << 20


# The digits an integer past 64 bits needs (2**64 has 20; -2**63 - 1 a minus and 19), which orjson reads as a float.
_LONG_DIGITS = re.compile(rb"\d{20,}|-\d{19}")
_HUGE = 2.0**63


def _holds_a_huge_whole_float(value: Any) -> bool:
    """Whether a parsed JSON value holds a float that is a whole number of magnitude 2**63 or more (what orjson
    makes of an integer past 64 bits), anywhere inside."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if abs(item) >= _HUGE and item.is_integer():
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def parse_json(raw: bytes | bytearray) -> Any:
    """A JSON body (400 when it is not JSON, or nested too deeply to parse).

    orjson parses it: on every kind of value at most about 0.15 microseconds each, where `json.loads` takes up to
    1.4 and msgspec up to 12 (on `1e300`), all while holding the interpreter lock. What orjson refuses in a small body
    is parsed again by `json.loads`, which decides as it always did (it takes NaN and lone surrogate escapes, which
    orjson refuses; fields then name them); a big body orjson refuses is refused. orjson reads an integer past 64
    bits as a float (`2**64` as 1.8446744073709552e+19): where the body has the digits of one (20 or more, or a minus
    and 19) and orjson's answer holds a whole float that large, `json.loads` parses it again, keeping the integer (a
    field then names it as sent). Digits in a string (a prompt's) cost a walk of the answer, not a second parse. A key
    given twice in one object is refused (`check_unique_keys`).

    Raises:
        APIError: 400 not JSON, nested too deeply, or a key given twice (named).
    """
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        if len(raw) >= BIG_BODY_BYTES:
            raise APIError(400, f"the request body is not valid JSON: {error}"[:500]) from None
    else:
        if _LONG_DIGITS.search(raw) is None or not _holds_a_huge_whole_float(parsed):
            check_unique_keys(raw)
            return parsed
    try:  # decoded first: json.loads would take UTF-16 and UTF-32 bytes too (JSON's encoding is UTF-8)
        parsed = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=_refuse_duplicates)
    except _DuplicateKey:
        raise _duplicate_error(raw) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        if "int_max_str_digits" in str(error):  # Python's own limit, whose advice is for the server's code
            digits = f"{sys.get_int_max_str_digits():,}"
            raise APIError(
                400, f"the request body holds an integer of over {digits} digits: no field takes one"
            ) from None
        raise APIError(400, f"the request body is not valid JSON: {type(error).__name__}: {error}"[:500]) from None
    _refuse_lone_surrogates(parsed)  # (only json.loads takes them: orjson refuses a body holding one)
    return parsed


def _refuse_lone_surrogates(body: Any) -> None:
    """A 400 naming where the body holds a lone surrogate (a JSON "\\ud800" escape), in a value or a field name: it is
    not text, and no field takes one (a stop string holding one could never match; a tokenizer cannot encode one).

    Args:
        body: the parsed body (a small one: what orjson refused and json.loads took).
    """
    stack: list[tuple[str, str, Any]] = [("", "", body)]  # (top-level field, path, value)
    while stack:
        top, where, value = stack.pop()
        if isinstance(value, str):
            found = lone_surrogate(value)
            if found is not None:
                raise APIError(400, f"{where}: {_surrogate_reason(found)}", top or None)
        elif isinstance(value, dict):
            for key, item in value.items():
                path = f"{where}.{key}" if where else key
                found = lone_surrogate(key)
                if found is not None:
                    raise APIError(
                        400, f"{where or 'the body'}: the field name {key!r} {_surrogate_reason(found)}", top or None
                    )
                stack.append((top or key, path, item))
        elif isinstance(value, list):
            stack.extend((top, f"{where}[{index}]", item) for index, item in enumerate(value))


def _surrogate_reason(found: str) -> str:
    return f"holds a lone surrogate ({ascii(found)[1:-1]}), which is not text; fix or drop that \\u escape"


class _DuplicateKey(ValueError):
    """A key given twice in one JSON object."""


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads`' object hook: the object, unless a key comes twice."""
    built = dict(pairs)
    if len(built) != len(pairs):
        raise _DuplicateKey
    return built


class _Pairs(list):
    """A JSON object kept as its (key, value) pairs, in order (`_duplicate_path`)."""


def check_unique_keys(raw: bytes | bytearray) -> None:
    """Refuse a JSON body (valid JSON) holding an object with a key given twice, anywhere. It is parsed again by
    `json.loads` with an object hook, its numbers left unconverted (`len` of their text: converting a float such as
    `1.2345678901234567e-300` is what makes `json.loads` slow): about orjson's own time on the bodies a worker
    reads (6-16 MB of token ids, floats of every spelling, strings; at most 1.6 times on 200,000 chat messages).

    Raises:
        APIError: 400 naming the key.
    """
    try:
        json.loads(raw, object_pairs_hook=_refuse_duplicates, parse_float=len, parse_int=len)
    except _DuplicateKey:
        raise _duplicate_error(raw) from None
    except (ValueError, RecursionError) as error:  # deeper than json.loads goes (orjson parsed it)
        raise APIError(400, f"the request body is not valid JSON: {type(error).__name__}: {error}"[:500]) from None


def _duplicate_error(raw: bytes | bytearray) -> APIError:
    """The 400 for a body (valid JSON) with a key given twice, naming the first such key by its path
    (`logit_bias.50`, `messages[0].content`). Only a refused body pays for the second parse that finds it."""
    try:
        key, path = _duplicate_path(json.loads(raw, object_pairs_hook=_Pairs, parse_float=len, parse_int=len))
    except RecursionError:  # nested deeper after the duplicate than json.loads goes
        return APIError(400, "a key is given twice in one JSON object: send each field once")
    return APIError(400, f"{key!r} is given twice in one JSON object ({path}): send each field once", path)


def _duplicate_path(body: Any) -> tuple[str, str]:
    """The first key given twice in `body` (objects as `_Pairs`) in a depth-first walk, and its path. Each place is
    kept as (its parent's place, its key or index) and only the path found is written out: writing every place's
    path would copy its parent's for each item (a long key above a long array made gigabytes)."""
    stack: list[tuple[tuple | None, Any]] = [(None, body)]
    while stack:
        place, value = stack.pop()
        if isinstance(value, _Pairs):
            seen: set[str] = set()
            for key, _ in value:
                if key in seen:
                    return key, _path((place, key))
                seen.add(key)
            stack.extend(((place, key), item) for key, item in reversed(value))
        elif isinstance(value, list):
            stack.extend(((place, index), item) for index, item in reversed(list(enumerate(value))))
    raise AssertionError("no key given twice")  # only called for a body json.loads refused for one


def _path(place: tuple) -> str:
    """`logit_bias.50`, `messages[1].content`: a place (parent place, key or index) written out."""
    steps: list[str | int] = []
    while place is not None:
        place, step = place
        steps.append(step)
    steps.reverse()
    return "".join(
        f"[{step}]" if isinstance(step, int) else f".{step}" if index else step for index, step in enumerate(steps)
    )
