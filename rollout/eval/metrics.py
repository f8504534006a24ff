"""`rollout-eval --metric`: whether a completion answers its row correctly.

A metric is a function `(completion: str, answer: str) -> bool`; the built-in ones are `exact_match` and `numeric`,
and `module:function` names any other importable one (the current directory is on the import path, as with
`python -m`).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

Metric = Callable[[str, str], bool]

# A number as GSM8K and friends write them: an optional sign and "$", digits (thousands commas only in groups of
# three), decimals, an exponent.
_NUMBER = re.compile(r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\$?\.\d+")
# GSM8K's final-answer marker: the answer follows "####".
_FINAL_ANSWER = re.compile(r"####\s*(.+)")


class MetricError(ValueError):
    """A --metric that cannot be used; the message says why and what to do."""


def exact_match(completion: str, answer: str) -> bool:
    """The completion equals the answer once surrounding whitespace is stripped from both."""
    return completion.strip() == str(answer).strip()


def numeric(completion: str, answer: str) -> bool:
    """The completion's final number equals the answer's, as GSM8K scores them.

    The answer's number is the one after "####" (GSM8K's answers end "#### 42"), else its last number; the
    completion's is likewise the number after its own "####" if it wrote one, else the last number in it (lm-eval's
    flexible extraction). Thousands commas, a "$" and a trailing "." are ignored; numbers compare as decimals, so
    "42" equals "42.0". A completion or answer without a number is not correct.
    """
    expected, got = final_number(str(answer)), final_number(completion)
    return expected is not None and got is not None and expected == got


def final_number(text: str) -> Decimal | None:
    """The number a text ends with, as `numeric` reads it (None when there is none)."""
    marked = _FINAL_ANSWER.search(text)
    numbers = _NUMBER.findall(marked.group(1) if marked else text)
    if not numbers:
        return None
    token = (numbers[0] if marked else numbers[-1]).replace(",", "").replace("$", "")
    try:
        return Decimal(token.rstrip("."))
    except InvalidOperation:
        return None


BUILT_IN: dict[str, Metric] = {"exact_match": exact_match, "numeric": numeric}


def load_metric(spec: str) -> Metric:
    """The metric `spec` names: "exact_match", "numeric" or "module:function".

    The current directory is importable while the module is imported (as with `python -m`), and only then: a file
    there named like a library must not shadow it for the rest of the run.

    Raises:
        MetricError: an unknown name, a module that cannot be imported, or no callable of that name in it.
    """
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module_name, colon, function_name = spec.partition(":")
    if not colon or not module_name or not function_name:
        raise MetricError(
            f"--metric {spec}: expected {', '.join(BUILT_IN)} or module:function (a function "
            "(completion, answer) -> bool in an importable module)"
        )
    if module_name.endswith(".py") or "/" in module_name:
        raise MetricError(
            f"--metric {spec}: name the module, not its file: --metric "
            f"{module_name.removesuffix('.py').replace('/', '.')}:{function_name}, run from the directory above it"
        )
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and module_name.startswith(error.name):
            raise MetricError(
                f"--metric {spec}: no module named {module_name}; run from the directory that holds "
                f"{module_name.replace('.', '/')}.py or put that directory on PYTHONPATH"
            ) from None
        raise MetricError(f"--metric {spec}: {module_name} imports {error.name}, which is not installed") from None
    except Exception as error:  # a syntax error, or whatever the module raises while it loads
        raise MetricError(f"--metric {spec}: importing {module_name} failed: {type(error).__name__}: {error}") from None
    finally:
        sys.path.remove(os.getcwd())
    function = getattr(module, function_name, None)
    if not callable(function):
        raise MetricError(f"--metric {spec}: {module_name} has no function {function_name}")
    return function


def score(metric: Metric, spec: str, completion: str, answer: object, row: int) -> bool:
    """`metric(completion, str(answer))`, which must be a bool (or 0 / 1, numpy's bools included).

    Args:
        metric: the metric.
        spec: its name, for messages.
        completion: the sample's text.
        answer: the row's reference answer (given to the metric as text).
        row: the dataset row, for messages.
    Raises:
        MetricError: the metric returned something else, or raised (naming the metric, the row and the error).
    """
    try:
        verdict = metric(completion, str(answer))
    except Exception as error:
        raise MetricError(f"--metric {spec} raised {type(error).__name__} on row {row}: {error}") from None
    try:
        valid = verdict in (True, False)  # 0, 1 and numpy's bools compare equal to them
    except Exception:  # an array's truth value is ambiguous
        valid = False
    if not valid or isinstance(verdict, float):
        raise MetricError(f"--metric {spec} returned {verdict!r} on row {row}; a metric returns True or False")
    return bool(verdict)
