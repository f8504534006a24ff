"""A local dataset file's rows, read as written: JSON values keep their types (an answer `5` stays 5, not 5.0 beside a
2.5; a number `1.50` is a float whose text stays "1.50", as `exact_match` compares it), CSV fields stay strings ("007" stays "007"; "NA" is text, not missing), Parquet values keep the file's schema.

Only a regular file is read (a FIFO or /dev/zero is refused by name, never waited on), JSONL and CSV line by line
with a limit on each line's length (`files.read_lines`: a 50 MB line is refused at the limit, never held whole), and
every flaw is a `DatasetError` naming the file and its line (or row): a malformed line, bytes that are not UTF-8, a
JSON string holding a lone surrogate (a `"\\ud800"` escape: no tokenizer or UTF-8 file can hold it).
"""

from __future__ import annotations

import contextlib
import csv
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO

from rollout.cli.hub import first_line
from rollout.eval.files import BOM, FileRefused, open_for_reading, read_lines
from rollout.validation import lone_surrogate

# The flag that raises the limit on a line's length, named in its error.
LIMIT_FLAG = "--max-line-chars"
BOM_BYTES = BOM.encode("utf-8")


class WrittenFloat(float):
    """A JSON number with a fraction or exponent, as `json.loads` reads it, whose `str` is the text the file wrote:
    `str(1.50)` is "1.5", and the answer "1.50" scored as "1.5" would fail a completion that wrote it as the file did.
    It is a float everywhere else (arithmetic, comparisons, and `json.dumps`, which writes it as a float)."""

    text: str

    def __new__(cls, text: str) -> WrittenFloat:
        number = super().__new__(cls, text)
        number.text = text
        return number

    def __str__(self) -> str:
        return self.text


class DatasetError(ValueError):
    """A dataset that cannot be read as asked; the message names the flag and says what to do."""


def read_file_rows(dataset: str, path: str, ending: str, max_line_chars: int) -> list[dict[str, Any]]:
    """A local file's rows as written.

    Args:
        dataset: the dataset as given (named in errors).
        path: its path, user-expanded.
        ending: its ending: ".jsonl", ".json" (a JSON array of rows, or JSON lines), ".csv" or ".parquet".
        max_line_chars: the longest JSONL or CSV line read, in characters.
    Raises:
        DatasetError: naming the file and what is wrong: not a regular file, unreadable, a malformed, over-long or
            non-UTF-8 line, a string that is not valid Unicode, a row that is not an object of fields.
    """
    try:
        with open_for_reading(path) as file:
            if ending == ".parquet":
                import pyarrow.parquet

                return _objects(dataset, pyarrow.parquet.read_table(file).to_pylist())
            if ending == ".csv":
                return _read_csv(dataset, read_lines(file, max_line_chars, LIMIT_FLAG), max_line_chars)
            if ending == ".json" and _first_byte(file) == b"[":  # a JSON array of rows: a regular file, held whole
                file.seek(0)
                named_twice: dict[int, str] = {}
                rows = json.loads(
                    file.read().decode("utf-8-sig"),
                    object_pairs_hook=_noting_twice(named_twice),
                    parse_float=WrittenFloat,
                )
                for index, row in enumerate(rows):
                    _check_fields_once(dataset, f"row {index}", row, named_twice)
                    _check_text(dataset, f"row {index}", row)
                return _objects(dataset, rows)
            file.seek(0)
            lines = read_lines(file, max_line_chars, LIMIT_FLAG)
            # (a .json file may be one object written over many lines: valid JSON, but not a row per line)
            hint = "; a .json dataset is a JSON array of rows, or one row object per line" if ending == ".json" else ""
            texts = [(number, line) for number, line in lines if line.strip()]
            return _objects(
                dataset, [_json_line(dataset, number, row, line, hint) for row, (number, line) in enumerate(texts)]
            )
    except DatasetError:
        raise
    except FileRefused as error:
        raise DatasetError(f"--dataset {dataset}: {error}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise DatasetError(f"--dataset {dataset}: cannot be read ({first_line(error)})") from None
    except Exception as error:  # pyarrow's own errors for a file that is no Parquet
        raise DatasetError(
            f"--dataset {dataset}: cannot be read ({type(error).__name__}: {first_line(error)})"
        ) from None


def _first_byte(file: BinaryIO) -> bytes:
    """The file's first byte that is not whitespace (nor a UTF-8 byte order mark), b"" if none: b"[" for a JSON array
    however it is indented, as `json.loads` reads it."""
    data = file.read(len(BOM_BYTES)).removeprefix(BOM_BYTES)
    while True:
        stripped = data.lstrip(b" \t\r\n")
        if stripped:
            return stripped[:1]
        data = file.read(1 << 16)
        if not data:
            return b""


def _objects(dataset: str, rows: list[Any]) -> list[dict[str, Any]]:
    """The rows, each checked to be an object of fields."""
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(f"--dataset {dataset}: row {index} is a {type(row).__name__}, not an object of fields")
    return rows


def _json_line(dataset: str, number: int, index: int, line: str, hint: str = "") -> Any:
    """Line `number`'s value, row `index` of the dataset (rows count from 0 and skip blank lines, as the errors about
    a row's fields and the output's `prompt_index` do: both are named), its strings checked to be valid Unicode
    (`hint` ends the message of a line that is not JSON)."""
    where = f"line {number} (row {index})"
    named_twice: dict[int, str] = {}
    try:
        row = json.loads(line, object_pairs_hook=_noting_twice(named_twice), parse_float=WrittenFloat)
    except json.JSONDecodeError as error:
        raise DatasetError(f"--dataset {dataset}: {where} is not JSON ({error.msg}){hint}") from None
    except RecursionError:
        raise DatasetError(f"--dataset {dataset}: {where} is nested too deeply to read") from None
    _check_fields_once(dataset, where, row, named_twice)
    _check_text(dataset, where, row)
    return row


def _noting_twice(named_twice: dict[int, str]) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A `json.loads` object hook that builds each object as `json.loads` does (the last value of a field named
    twice) and notes, by the object's id, the first field it names twice."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        built = dict(pairs)
        if len(built) != len(pairs):
            seen: set[str] = set()
            named_twice[id(built)] = next(key for key, _ in pairs if key in seen or seen.add(key))
        return built

    return hook


def _check_fields_once(dataset: str, where: str, row: Any, named_twice: dict[int, str]) -> None:
    """A row (a top-level object) names each field once, as a CSV header must: one value of a field named twice would
    be read without a word. Objects inside a row's fields are read as `json.loads` and `datasets` read them."""
    if isinstance(row, dict) and id(row) in named_twice:
        raise DatasetError(
            f"--dataset {dataset}: {where} names the field {named_twice[id(row)]!r} twice (only one value can be "
            "read); give each field once"
        )


def _check_text(dataset: str, where: str, value: Any) -> None:
    """Every string in a JSON value (keys too) is valid Unicode: JSON's "\\ud800" escapes can make lone surrogates,
    which no tokenizer encodes and no UTF-8 file holds.

    Raises:
        DatasetError: naming the line (or row) and the field, e.g. "line 3, field prompt[0].content".
    """
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:  # not recursive: a deeply nested line must not exhaust the stack
        field, item = pending.pop()
        if isinstance(item, str):
            refused = lone_surrogate(item)
            if refused is not None:
                raise DatasetError(
                    f"--dataset {dataset}: {where}, field {field or '(the value itself)'}: holds a lone surrogate "
                    f"({ascii(refused)[1:-1]}), which is not text a tokenizer can read; fix or drop that \\u escape"
                )
        elif isinstance(item, dict):
            for key, child in item.items():
                if lone_surrogate(key) is not None:
                    raise DatasetError(
                        f"--dataset {dataset}: {where}: the field name {ascii(key)} holds a lone surrogate, which is "
                        "not text; fix or drop that \\u escape"
                    )
                pending.append((f"{field}.{key}" if field else key, child))
        elif isinstance(item, list):
            pending.extend((f"{field}[{index}]", child) for index, child in enumerate(item))


def _read_csv(dataset: str, lines: Iterable[tuple[int, str]], max_chars: int) -> list[dict[str, Any]]:
    """CSV rows as strings under the header's names; a row with more or fewer fields than the header is named, and
    so is a field longer than `max_chars` (a quoted field may span lines: an unclosed quote would take the rest)."""
    with _field_limit(max_chars):
        reader = csv.reader(line for _, line in lines)
        try:
            header = next(reader, None)
            if header is None:
                return []
            # (empty names, a spreadsheet's trailing commas, are no fields anyone can ask for: as before, not checked)
            twice = next((name for index, name in enumerate(header) if name and name in header[:index]), None)
            if twice is not None:  # a dict of the row would keep only the last column of that name
                raise DatasetError(
                    f"--dataset {dataset}: line {reader.line_num}: the header names the field {twice!r} twice; "
                    "give each column its own name"
                )
            rows = []
            for fields in reader:
                if not fields:
                    continue
                if len(fields) != len(header):
                    raise DatasetError(
                        f"--dataset {dataset}: line {reader.line_num} (row {len(rows)}) has {len(fields)} fields, the header "
                        f"{len(header)}"
                    )
                rows.append(dict(zip(header, fields)))
        except csv.Error as error:
            if "field larger than field limit" in str(error):
                raise DatasetError(
                    f"--dataset {dataset}: line {reader.line_num}: a field is longer than {max_chars:,} characters "
                    f"(the limit, {LIMIT_FLAG} {max_chars}; a quote left open?); shorten or leave out such fields, "
                    f"or raise {LIMIT_FLAG}"
                ) from None
            raise DatasetError(f"--dataset {dataset}: line {reader.line_num} is not CSV ({error})") from None
    return rows


@contextlib.contextmanager
def _field_limit(limit: int) -> Iterator[None]:
    """csv's limit on a field's length set to `limit` while reading (it is process-wide: restored after)."""
    before = csv.field_size_limit(limit)
    try:
        yield
    finally:
        csv.field_size_limit(before)
