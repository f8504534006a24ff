"""The Python API reference (docs/reference/api.md) documents what it shows: every `::: dotted.path` entry that is a
class or a function documents each argument of its signature in an Args section (of the class or of its
`__init__`; a dataclass's fields may be its Attributes), read as the site renders it (Google style, through
docs_tools/docstring_sections.py). Every public name of `rollout` and `trainer_bridge` has an entry (or, for the
settings dataclasses, a generated table of its fields), and `RolloutGRPOTrainer` comes first."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import rollout
import rollout.presets
import trainer_bridge
import trainer_bridge.trl

griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
ENTRIES = re.findall(r"^::: ([\w.]+)", (REFERENCE / "api.md").read_text(), re.M)
FIELD_TABLES = {
    name for page in REFERENCE.glob("*.md") for name in re.findall(r"generated: fields (\w+)", page.read_text())
}
EXPORTS = [("rollout", name) for name in sorted(rollout._EXPORTS)] + [
    ("trainer_bridge", name) for name in trainer_bridge.__all__
]
# The subpackages users import from too: their classes and functions (constants such as PRESETS have no arguments).
SUBPACKAGE_EXPORTS = [
    (package.__name__, name)
    for package in (rollout.presets, trainer_bridge.trl)
    for name in package.__all__
    if not name.isupper()
]


def _sections() -> Any:
    spec = importlib.util.spec_from_file_location("docstring_sections", ROOT / "docs_tools" / "docstring_sections.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SECTIONS = _sections()


def resolve(dotted: str) -> Any:
    """The object an entry names: its longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            value = getattr(value, part)
        return value
    raise ImportError(dotted)


def documented(docstring: str | None, kinds: tuple[str, ...]) -> set[str]:
    """The names the docstring's sections of these kinds document (`*args` as `args`), parsed as the site does."""
    if not docstring:
        return set()
    # A leading newline keeps a docstring whose first line is "Args:" as written (cleandoc dedents the lines after
    # the first by their common indentation).
    text = "\n" + SECTIONS.separated(inspect.cleandoc(docstring))
    sections = griffe.Docstring(text).parse("google", warnings=False)
    return {item.name.lstrip("*") for section in sections if section.kind.value in kinds for item in section.value}


def undocumented(obj: Any) -> list[str]:
    """The arguments of a class's or function's signature that no Args section of its docstrings names."""
    try:
        parameters = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):  # an exception class keeping the built-in constructor: no arguments of ours
        return []
    names = documented(obj.__doc__, ("parameters", "other parameters"))
    if inspect.isclass(obj):
        # The class's own __init__: the site merges that one's docstring into the class's (an inherited one's
        # arguments show in the signature, but not its docstring).
        init = vars(obj).get("__init__")
        if inspect.isfunction(init):
            names |= documented(init.__doc__, ("parameters", "other parameters"))
        if dataclasses.is_dataclass(obj):  # its fields, and a dataclass base's where that one declares them (an
            for cls in obj.__mro__:  # entry of its own, which the class's docstring names)
                if dataclasses.is_dataclass(cls) and (cls is obj or f"`{cls.__name__}`" in obj.__doc__):
                    names |= documented(cls.__doc__, ("attributes",))
    return [name for name in parameters if name != "self" and name not in names]


def test_the_check_finds_an_undocumented_argument():
    def two(first: int, second: int, *rest: int) -> None:
        """Summary.
        Args:
            first: one.
            *rest: the others.
        Raises:
            ValueError: never.
        """

    class Built:
        def __init__(self, size: int, name: str):
            """
            Args:
                size: documented in the __init__.
            """

    class Inherited(Built):
        """Its own docstring, no Args."""

    assert undocumented(two) == ["second"]
    assert undocumented(Built) == ["name"]
    assert undocumented(Inherited) == ["size", "name"]


def test_trl_comes_first():
    assert ENTRIES[0] == "trainer_bridge.trl.RolloutGRPOTrainer"


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_documents_its_arguments(entry):
    obj = resolve(entry)
    assert inspect.isclass(obj) or inspect.isfunction(obj), f"{entry}: {type(obj)}"
    assert obj.__doc__, f"{entry} has no docstring"
    assert undocumented(obj) == [], f"{entry}: arguments without an Args entry"


@pytest.mark.parametrize(("package", "name"), EXPORTS + SUBPACKAGE_EXPORTS)
def test_every_public_name_has_a_reference_entry(package, name):
    value = getattr(importlib.import_module(package), name)
    entries = [entry for entry in ENTRIES if entry.rsplit(".", 1)[1] == name and resolve(entry) is value]
    assert entries or name in FIELD_TABLES, f"{package}.{name} has no entry in docs/reference/api.md"


def markup_outside_code(docstring: str | None) -> list[str]:
    """What Markdown would take for an HTML tag (`<id>`) or bold (`__base__`) outside backtick spans: the site drops
    the one and bolds the other."""
    parts = (docstring or "").split("`")
    return [match for part in parts[::2] for match in re.findall(r"<[A-Za-z/#][^>\n]*>|__\w+__", part)]


def test_the_check_finds_markup_outside_code():
    assert markup_outside_code('ids "req_<i>" and "__base__", but `"<id>#<i>"`') == ["<i>", "__base__"]


def rendered_docstrings(entry: str) -> list[tuple[str, str | None]]:
    """(name, docstring) of an entry and, for a class, of the public methods and properties the site shows."""
    obj = resolve(entry)
    members = [obj]
    if inspect.isclass(obj):
        members += [value for key, value in vars(obj).items() if not key.startswith("_") or key == "__init__"]
    return [
        (getattr(member, "__qualname__", entry), member.__doc__)
        for member in members
        if callable(member) or isinstance(member, property) or member is obj
    ]


@pytest.mark.parametrize("entry", ENTRIES)
def test_no_entry_loses_text_to_markup(entry):
    found = [(name, text) for name, doc in rendered_docstrings(entry) for text in markup_outside_code(doc)]
    assert not found, found


def malformed_items(docstring: str | None) -> list[str]:
    """Raises entries whose exception is not a name (an inline second exception, a wrapped line read as an entry),
    and Returns sections split into several entries by a wrapped line, parsed as the site does."""
    if not docstring:
        return []
    text = "\n" + SECTIONS.separated(inspect.cleandoc(docstring))
    found = []
    for section in griffe.Docstring(text).parse("google", warnings=False):
        if section.kind.value == "raises":
            found += [
                str(item.annotation) for item in section.value if not re.fullmatch(r"[\w.]+", str(item.annotation))
            ]
        if section.kind.value == "returns" and len(section.value) > 1:
            found.append(f"Returns in {len(section.value)} entries: indent its wrapped lines")
    return found


def test_the_check_finds_malformed_raises_and_returns():
    raises = "Do.\n\nRaises:\n    ValueError: bad. TimeoutError: not applied in\n    time. RuntimeError: stopped.\n"
    assert malformed_items(raises) == ["time. RuntimeError"]
    assert malformed_items("Do.\n\nReturns:\n    The outputs of the step, then\n    the rest.\n")


@pytest.mark.parametrize("entry", ENTRIES)
def test_raises_and_returns_render_as_written(entry):
    found = [(name, text) for name, doc in rendered_docstrings(entry) for text in malformed_items(doc)]
    assert not found, found
