"""A Griffe extension for the API reference: a Google-style section title (`Args:`, `Raises:`, `Returns:`, ...) on
the line right under the text or section before it starts a section, as Python's Google style has it. Griffe's parser
starts a section only after a blank line, and rendered such a title and its entries as plain text.

mkdocs.yml loads it (mkdocstrings' `extensions`), and tests/test_api_reference.py reads docstrings through
`separated`, so the test sees the sections the site renders.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

TITLE = re.compile(
    r"^(Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Other Parameters|Raises|Returns|Yields|"
    r"Attributes|Examples?):$"
)


def separated(text: str) -> str:
    """`text` with a blank line above each section title that follows a line of text (outside code fences).

    Args:
        text: a cleaned docstring (`inspect.cleandoc`'s: titles at column 0).
    """
    lines: list[str] = []
    fenced = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and TITLE.match(line) and lines and lines[-1].strip():
            lines.append("")
        lines.append(line)
    return "\n".join(lines)


class SeparatedSections(griffe.Extension):
    """Puts every docstring Griffe loads through `separated`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Separate the sections of `obj`'s docstring, before anything parses it.

        Args:
            obj: the class, function, attribute or module just loaded.
            **kwargs: the rest of Griffe's event (node, agent).
        """
        if obj.docstring is not None:
            obj.docstring.value = separated(obj.docstring.value)
