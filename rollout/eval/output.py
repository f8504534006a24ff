"""`rollout-eval --output`: the JSONL rows and the summary beside them (`OUTPUT.summary.json`).

Both paths are checked before anything runs (an hour of generation is never lost to an unwritable path): each must be
a regular file or a new path in a writable directory, and not the dataset. A FIFO, a device or a directory is refused
by name, and the files are opened without blocking (`files.open_for_writing`), so a FIFO made after the check can
never hang the run either.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from rollout.eval.errors import EvalError
from rollout.eval.files import FileRefused, check_regular, open_for_writing


def summary_path(output: str) -> str:
    """Where the summary of a run writing its rows to `output` goes."""
    return f"{output}.summary.json"


def check_output(output: str, dataset: str) -> None:
    """--output (and its summary file) can be written by this run and is not its own dataset.

    Args:
        output: --output as given.
        dataset: --dataset as given.
    Raises:
        EvalError: naming --output and what is wrong: no file name, no such directory, not writable, not a regular
            file (a FIFO, a device, a directory), or the dataset itself.
    """
    path = os.path.abspath(os.path.expanduser(output))
    folder = os.path.dirname(path)
    if not output or os.path.isdir(path):
        raise EvalError(f"--output {output!r}: name a file to write the rows to, e.g. --output eval.jsonl")
    if not os.path.isdir(folder):
        raise EvalError(f"--output {output}: no such directory {folder}")
    for target in (path, summary_path(path)):
        try:
            exists = check_regular(target)
        except FileRefused as error:
            what = f"--output {output}" if target == path else f"--output {output}: its summary file {target}"
            raise EvalError(f"{what} {error}; name a regular file or a new path") from None
        if not os.access(target if exists else folder, os.W_OK):
            raise EvalError(f"--output {output}: {target if exists else folder} is not writable")
    source = os.path.expanduser(dataset)
    if os.path.isfile(source) and os.path.exists(path) and os.path.samefile(path, source):
        raise EvalError(f"--output {output} is the dataset itself: write the rows to another file")


def write_rows(output: str | None, rows: list[dict[str, Any]]) -> str | None:
    """The rows as JSONL at `output` (None: not written); non-ASCII text as itself, values JSON lacks (dates) as text.
    A summary an earlier run left beside them is removed first: this run's, if it gets that far, is written after.

    Args:
        output: --output as given (None: no output).
        rows: the rows, in order.
    Returns:
        Where they went (None: nowhere).
    Raises:
        EvalError: the file cannot be written.
    """
    if output is None:
        return None
    _discard_summary(output)  # an earlier run's summary must not stand beside these rows, which may never get one
    _write(output, (json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows))
    return output


def _discard_summary(output: str) -> None:
    """Remove the summary file beside `output` if one is there (a regular file: nothing else is touched)."""
    path = summary_path(os.path.expanduser(output))
    try:
        if check_regular(path):
            os.remove(path)
    except FileRefused:
        return  # not a file this run wrote: writing the summary, if it comes to that, refuses it by name
    except OSError as error:
        raise EvalError(
            f"--output {output}: its old summary {path} cannot be removed ({error.strerror or error})"
        ) from None


def write_summary(output: str, summary: dict[str, Any]) -> str:
    """The summary as JSON beside the rows; returns its path.

    Args:
        output: --output as given.
        summary: the JSON-ready summary.
    Raises:
        EvalError: the file cannot be written.
    """
    path = summary_path(output)
    _write(path, [json.dumps(summary, indent=2, default=str)])
    return path


def _write(path: str, pieces: Iterable[str]) -> None:
    """The text `pieces` into the regular file at `path` (created or replaced), or an EvalError naming it."""
    try:
        with open_for_writing(os.path.expanduser(path)) as file:
            for piece in pieces:
                file.write(piece)
    except FileRefused as error:
        raise EvalError(f"--output {path}: {error}; name a regular file or a new path") from None
    except OSError as error:
        raise EvalError(f"--output {path}: cannot be written ({error.strerror or error})") from None
    except UnicodeEncodeError as error:  # a lone surrogate the dataset checks missed: never a traceback
        raise EvalError(f"--output {path}: a row holds text that is not valid Unicode ({error.reason})") from None
