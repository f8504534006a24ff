"""MkDocs hooks: the reference tables are generated from the code, so the documentation cannot drift from it.

A page holds a table between a marker and `<!-- end generated -->`, each on a line of its own:

    <!-- generated: options rollout-worker -->        every flag of a command, from its argparse parser
    <!-- generated: fields SamplingParams -->          every field of a dataclass: type, default, the comment above it
    <!-- generated: docstring rollout.protocol -->   a module's docstring, verbatim (a specification)
    <!-- generated: prose rollout.service.observability.metrics -->   a module's docstring as markdown (its tables)

The table is committed with the page, so that it reads the same in the repository as on the site; the site's build
generates it afresh, and tests/test_docs.py fails while a committed table differs from the code's. After changing a
flag, a field or the protocol's docstring:

    python docs_tools/hooks.py          # rewrites the tables of every page under docs/

An unknown marker fails the build (`mkdocs build --strict` runs in CI).
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import importlib
import inspect
import os
import re
from typing import Any

from rollout.cli.parser import default_text

BLOCK = re.compile(r"^<!-- generated: (\w+) ([\w.-]+) -->\n.*?^<!-- end generated -->$", re.M | re.S)
END = "<!-- end generated -->"
# Command -> (module, function building its parser).
PARSERS = {
    "rollout-worker": ("rollout.service.launch.cli", "build_parser"),
    "rollout-eval": ("rollout.eval.cli", "build_parser"),
    "rollout-bench": ("rollout.benchmarks.cli", "build_parser"),
    "rollout-keygen": ("rollout.protocol.auth", "build_keygen_parser"),
}
# Modules whose docstring is a specification a page shows verbatim.
SPECIFICATIONS = {"rollout.protocol"}
# Modules whose docstring a page shows as markdown (a reference table written there, beside the code it describes).
PROSE = {"rollout.service.observability.metrics"}
# Dataclass -> its module.
DATACLASSES = {
    "SamplingParams": "rollout.sampling_params",
    "ContinuousBatchingConfig": "rollout.config",
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each generated block of the page with its table, made now."""
    return BLOCK.sub(lambda match: render(match.group(1), match.group(2)), markdown)


def refreshed(markdown: str) -> str:
    """A page's text with each generated block's table made afresh between its marker and its end."""
    return BLOCK.sub(
        lambda match: (
            f"<!-- generated: {match.group(1)} {match.group(2)} -->\n"
            f"{render(match.group(1), match.group(2)).rstrip()}\n{END}"
        ),
        markdown,
    )


def render(kind: str, name: str) -> str:
    """The markdown a marker stands for.

    Raises:
        ValueError: an unknown kind or name (the build fails, naming it).
    """
    if kind == "options" and name in PARSERS:
        module, function = PARSERS[name]
        # Flags default to ROLLOUT_<FLAG> variables when set: the site shows the code's defaults, never a value (an
        # API key) of the shell that built it.
        saved = {key: os.environ.pop(key) for key in list(os.environ) if key.startswith("ROLLOUT_")}
        try:
            return options_markdown(getattr(importlib.import_module(module), function)())
        finally:
            os.environ.update(saved)
    if kind == "fields" and name in DATACLASSES:
        return fields_markdown(getattr(importlib.import_module(DATACLASSES[name]), name))
    if kind == "docstring" and name in SPECIFICATIONS:
        return "```text\n" + inspect.getdoc(importlib.import_module(name)) + "\n```\n"
    if kind == "prose" and name in PROSE:
        return inspect.getdoc(importlib.import_module(name)) + "\n"
    raise ValueError(f"unknown generated marker: {kind} {name}")


def options_markdown(parser: argparse.ArgumentParser, heading: str = "###") -> str:
    """A table of a parser's flags (and, for subcommands, one table per subcommand under its own heading)."""
    # argparse's plain formatter: the parsers' own (`rollout.cli.parser`) end each help with its default, which the
    # table has a column for.
    formatter = argparse.HelpFormatter(parser.prog)
    rows, sections = [], []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, subparser in action.choices.items():
                # The description's own lines: its paragraphs and lists stay paragraphs and lists.
                sections.append(f"{heading} `{parser.prog} {command}`\n\n{_description(subparser.description)}\n\n")
                sections.append(options_markdown(subparser, heading + "#"))
            continue
        if isinstance(action, argparse._HelpAction):
            continue
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.dest}`"
        if action.metavar is not None and action.option_strings:
            flags += f" `{action.metavar if isinstance(action.metavar, str) else ' '.join(action.metavar)}`"
        choices = f" One of: {', '.join(f'`{c}`' for c in action.choices)}." if action.choices else ""
        hidden = action.default is None or action.default is False or action.default in (argparse.SUPPRESS, [])
        default = "" if hidden else _code(default_text(action.default))
        rows.append(
            f"| {flags} | {default} | {_cell(formatter._expand_help(action) if action.help else '')}{choices} |"
        )
    table = "| flag | default | meaning |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n\n" if rows else ""
    return table + "".join(sections)


def fields_markdown(cls: type) -> str:
    """A table of a dataclass's fields: name, type, default, and the comment written above the field in the code."""
    comments = field_comments(cls)
    rows = []
    for field in dataclasses.fields(cls):
        default = field.default if field.default is not dataclasses.MISSING else "(required)"
        cells = (f"`{field.name}`", _code(str(field.type)), _code(repr(default)))
        rows.append(f"| {' | '.join(cells)} | {_cell(comments.get(field.name, ''))} |")
    return "| field | type | default | meaning |\n| --- | --- | --- | --- |\n" + "\n".join(rows) + "\n"


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: the `#` lines right above its annotation in the class body. Fields right under another
    field (no comment, no blank line between) share its comment, pointing at the field that carries it."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    previous: str | None = None  # the field on the line above, if that line was a field
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            previous = None
            continue
        match = re.match(r"(\w+)\s*:", stripped)
        field = match.group(1) if match and line.startswith("    ") and not line.startswith("     ") else None
        if field and pending:
            comments[field] = " ".join(pending)
        elif field and previous in comments:
            owner = comments[previous] if comments[previous].startswith("As for `") else f"As for `{previous}`."
            comments[field] = owner
        pending = []
        previous = field
    return comments


def _description(text: str | None) -> str:
    """A subcommand's description as markdown: its paragraphs and lists as they are (`_prose`), and a block indented
    under a blank line (a list laid out in columns, as `--help` prints it) as a text block, kept as laid out."""
    blocks = []
    for block in re.split(r"\n\s*\n", text or ""):
        if block.startswith((" ", "\t")):
            blocks.append("```text\n" + inspect.cleandoc("x\n" + block)[2:] + "\n```")
        else:
            blocks.append(_prose(block))
    return "\n\n".join(blocks)


def _prose(text: str) -> str:
    """Help or description text as markdown: `<`, `>` and `&` outside backtick spans as HTML entities (Markdown
    would take `<MB>` for a tag and drop it); inside code spans they show as written."""
    parts = text.split("`")
    return "`".join(html.escape(part, quote=False) if index % 2 == 0 else part for index, part in enumerate(parts))


def _cell(text: str) -> str:
    """Text fit for one table cell (no line breaks, no bare pipes, `_prose`'s escapes)."""
    return _prose(" ".join(text.split())).replace("|", "\\|")


def _code(text: str) -> str:
    """Inline code for a table cell: a `|` inside backticks would still split the cell, so it is an HTML entity in an
    HTML code element."""
    return f"<code>{html.escape(' '.join(text.split())).replace('|', '&#124;')}</code>"


def main() -> None:
    """Rewrite the generated tables of every page under docs/ from the code, naming the pages that changed."""
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
    for folder, _, names in sorted(os.walk(docs)):
        for name in sorted(names):
            if not name.endswith(".md"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as page:
                text = page.read()
            fresh = refreshed(text)
            if fresh != text:
                with open(path, "w", encoding="utf-8") as page:
                    page.write(fresh)
                print(f"rewrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
