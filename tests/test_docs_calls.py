"""Every dotted name the README and the documentation site show as a call (`trainer_bridge.routing_replay(model,
routes)`, `rollout.generate_batch(...)`) is callable as shown: the name resolves the way Python resolves it after
`import trainer_bridge` (attributes first, a submodule where there is no attribute), and what it finds is not a
module. Code is both fenced blocks and inline code; `trainer.rollout.generate_rows(` (an attribute of an object) is
not a dotted name of the packages."""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`]+)`")
CALL = re.compile(r"(?<![\w.])((?:rollout|trainer_bridge)(?:\.\w+)+)\s*\(")


def shown_calls(text: str) -> set[str]:
    """The dotted names of the packages that `text`'s code (fenced blocks, then inline code) shows as calls."""
    blocks = FENCE.findall(text)
    prose = FENCE.sub("", text)
    return {name for code in (*blocks, *INLINE.findall(prose)) for name in CALL.findall(code)}


def resolve(dotted: str) -> Any:
    """What `dotted` names after `import` of its first part: each further part an attribute, or else a submodule."""
    parts = dotted.split(".")
    value: Any = importlib.import_module(parts[0])
    for index, part in enumerate(parts[1:], start=1):
        try:
            value = getattr(value, part)
        except AttributeError:
            if not isinstance(value, types.ModuleType):
                raise
            value = importlib.import_module(".".join(parts[: index + 1]))
    return value


CALLS = sorted({(page.relative_to(ROOT).as_posix(), name) for page in PAGES for name in shown_calls(page.read_text())})


def test_the_scan_finds_calls_in_code_only():
    text = (
        "`trainer_bridge.routing_replay(model, routes)` and rollout.generate_batch(x)\n```python\nrollout.a.b()\n```\n"
    )
    assert shown_calls(text) == {"trainer_bridge.routing_replay", "rollout.a.b"}
    assert shown_calls("`trainer.rollout.generate_rows(ids)`") == set()
    assert ("docs/guides/moe.md", "trainer_bridge.routing_replay") in CALLS


@pytest.mark.parametrize(("page", "name"), CALLS)
def test_every_name_shown_as_a_call_is_callable(page, name):
    value = resolve(name)
    assert callable(value) and not isinstance(value, types.ModuleType), f"{page} calls {name}, a {type(value)}"
