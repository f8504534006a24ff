"""The README and the documentation site read at a glance: no prose paragraph or list item is longer than `LIMIT`
characters. Fenced code, headings, tables, admonition markers and HTML are not prose; a list item is its own chunk,
as is each nested item. A longer chunk is a wall of text: split it into short paragraphs, or make its enumeration (of
flags, fields, options, cases) a list or a table.

`PENDING` lists the pages that still hold a longer chunk. Each must still hold one, so the set only shrinks: whoever
fixes a page removes it here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
LIMIT = 900

# Pages with a paragraph or list item over LIMIT characters, still to be split.
PENDING: set[str] = set()

FENCE = re.compile(r"```.*?```", re.S)
ITEM = re.compile(r"^\s*([-*]|\d+\.)\s")
NOT_PROSE = ("#", "|", "!", "<", ":::")


def chunks(text: str) -> list[str]:
    """The prose paragraphs and list items of a Markdown page, each joined into one line."""
    out: list[str] = []
    current: list[str] = []
    for line in FENCE.sub("", text).splitlines():
        stripped = line.strip()
        starts_item = bool(ITEM.match(line))
        if not stripped or stripped.startswith(NOT_PROSE) or starts_item:
            if current:
                out.append(" ".join(current))
            current = [stripped] if starts_item else []
            continue
        current.append(stripped)
    if current:
        out.append(" ".join(current))
    return out


def long_chunks(page: Path) -> list[str]:
    return [chunk for chunk in chunks(page.read_text()) if len(chunk) > LIMIT]


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def test_the_chunker_splits_paragraphs_and_items_and_skips_the_rest():
    text = (
        "# A heading\n\none paragraph\non two lines\n\n- an item\n  continued\n    - a nested item\n1. a numbered item\n"
        "```python\nnot = 'prose'\n```\n| a | table |\n!!! note\n<div>html</div>\nlast"
    )
    assert chunks(text) == [
        "one paragraph on two lines",
        "- an item continued",
        "- a nested item",
        "1. a numbered item",
        "last",
    ]


@pytest.mark.parametrize("page", PAGES, ids=[name(page) for page in PAGES])
def test_no_paragraph_or_list_item_is_a_wall_of_text(page):
    long = long_chunks(page)
    if name(page) in PENDING:
        assert long, f"{name(page)} has no chunk over {LIMIT} characters any more: remove it from PENDING"
    else:
        assert not long, "\n".join(f"{name(page)}: {len(chunk)} characters: {chunk[:100]}..." for chunk in long)


def test_every_pending_page_exists():
    assert PENDING <= {name(page) for page in PAGES}
