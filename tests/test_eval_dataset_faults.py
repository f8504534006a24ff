"""`rollout-eval` on rows that pandas wrote with missing values, on a dataset directory holding a malformed file, and
on a .json file holding one object written over several lines.

pandas writes a missing number as NaN: `json.dumps` of `DataFrame.to_dict("records")` rows writes the JSON literal
`NaN`, and `pyarrow.Table.from_pylist` keeps it as a float NaN in Parquet. rollout-eval read such a prompt as the
text "nan" and scored completions against the answer "nan", with exit status 0; a missing answer or prompt is
refused by name (as None and "" already were). The reference for "missing" is pandas' own `isna`.

A dataset directory (`--dataset DIR`) with a file `datasets` cannot parse was refused as "cannot be read (An error
occurred while generating the dataset)", which names nothing; the message now carries what `datasets` says went
wrong (its error's cause).

A .json file that is one JSON object over several lines (`json.dump(..., indent=2)` of a dict) was refused as "line 1
is not JSON", of a file that `json.load` reads; the message now says what a .json dataset must hold.

A directory with no data files (`--dataset ~`, a checkout) went to `datasets.load_dataset`, which globbed its whole
tree for minutes; it is refused at once, after a bounded scan of where the hub layout puts data files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout.eval.cli import main
from rollout.eval.file_rows import DatasetError

FLAGS = ["--model", "tiny", "--prompt-field", "question", "--max-new-tokens", "2"]


def error_of(capsys, dataset: Path, *extra: str) -> str:
    """rollout-eval's one error line (prefix dropped), checked: exit status 2, no traceback."""
    assert main([*FLAGS, "--dataset", str(dataset), *extra]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("rollout-eval: error: ")]
    assert len(lines) == 1, err
    return lines[0].removeprefix("rollout-eval: error: ")


def pandas_rows(column: str, values: list) -> list[dict]:
    """Two rows as pandas gives them, `column` holding `values` (a float column: its missing value is NaN)."""
    frame = pd.DataFrame({"question": ["What is 2+2?", "What is 3+3?"], "answer": ["4", "6"]})
    frame[column] = values
    return frame.to_dict("records")


def write(tmp_path: Path, kind: str, rows: list[dict]) -> Path:
    if kind == "jsonl":
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))  # NaN written as the literal NaN
    else:
        path = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)  # NaN kept as a float NaN, not a null
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_nan_answer_is_a_missing_answer(capsys, tmp_path, kind):
    rows = pandas_rows("answer", [4.0, None])
    assert pd.isna(rows[1]["answer"])
    message = error_of(capsys, write(tmp_path, kind, rows), "--answer-field", "answer")
    assert message.startswith("--answer-field answer: row 1 has no answer (NaN, a missing value)")


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_nan_prompt_is_a_missing_prompt(capsys, tmp_path, kind):
    rows = pandas_rows("question", [17.0, None])  # a prompt column of numbers (a number is read as its text)
    assert pd.isna(rows[1]["question"])
    message = error_of(capsys, write(tmp_path, kind, rows))
    assert message == "--prompt-field question: row 1 has an empty prompt (NaN, a missing value)"


def test_a_malformed_file_in_a_dataset_directory_is_named(capsys, tmp_path, monkeypatch):
    import logging
    import sys

    import datasets

    # datasets logs the file's error to a handler made on first use, bound to the sys.stderr of that moment: under
    # pytest, an earlier test's capture, closed by now (logging would print its own "Logging error" traceback).
    for handler in logging.getLogger("datasets").handlers:
        monkeypatch.setattr(handler, "stream", sys.stderr)

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"question": "What is 2+2?"}\n{"question": \n')
    with pytest.raises(datasets.exceptions.DatasetGenerationError) as reference:
        datasets.load_dataset(str(folder), split="train")
    cause = reference.value.__cause__
    message = error_of(capsys, folder)
    assert message == f"--dataset {folder}: cannot be read ({type(cause).__name__}: {str(cause).splitlines()[0]})"


def test_a_json_object_over_several_lines_says_what_a_json_dataset_holds(capsys, tmp_path):
    path = tmp_path / "columns.json"
    path.write_text(json.dumps({"question": ["What is 2+2?"], "answer": ["4"]}, indent=2))
    json.loads(path.read_text())  # valid JSON, though not rows
    message = error_of(capsys, path)
    assert message == (
        f"--dataset {path}: line 1 (row 0) is not JSON (Expecting property name enclosed in double quotes); a .json dataset "
        "is a JSON array of rows, or one row object per line"
    )


def test_a_large_directory_with_no_data_files_is_refused_before_datasets_scans_it(capsys, tmp_path, monkeypatch):
    """A large directory with no data file where a dataset directory holds them (a checkout, a home directory) is
    refused at once, naming --dataset and what was looked for: `datasets.load_dataset` would glob its whole tree
    (minutes on a home directory) and read whatever it found. The scan is bounded (here at 20 entries): a data file
    deeper than dataset layouts put one is not looked for, nor one past the bound."""
    import datasets

    from rollout.eval import dataset_folder

    def no_load(*args, **kwargs):
        raise AssertionError("datasets.load_dataset was called")

    monkeypatch.setattr(datasets, "load_dataset", no_load)
    monkeypatch.setattr(dataset_folder, "MAX_SCANNED", 20)
    checkout = tmp_path / "checkout"
    (checkout / "src" / "pkg" / "deep" / "deeper").mkdir(parents=True)
    for index in range(25):
        (checkout / "src" / "pkg" / f"module{index}.py").write_text("x = 1\n")
    (checkout / "README.md").write_text("# a project\n")
    (checkout / "requirements.txt").write_text("torch\n")  # text, but not named as a split
    (checkout / ".git").mkdir()
    (checkout / ".git" / "train.jsonl").write_text('{"question": "hidden"}\n')  # hidden: datasets leaves it out
    (checkout / "src" / "pkg" / "deep" / "deeper" / "train.jsonl").write_text('{"question": "too deep"}\n')
    message = error_of(capsys, checkout)
    assert message.startswith(f"--dataset {checkout}: a directory of over 20 entries with no data file (.jsonl, ")
    assert "top level, in a folder one level down (train/, data/), in data/*/ or */train/," in message

    crowded = tmp_path / "crowded"
    crowded.mkdir()
    for index in range(30):
        (crowded / f"note{index}.md").write_text("")
    (crowded / "zz").mkdir()
    (crowded / "zz" / "train.jsonl").write_text('{"question": "after the bound"}\n')
    assert "a directory of over 20 entries" in error_of(capsys, crowded)

    # A checkout whose bulk is hidden (the README's own .venv): `datasets` walks it before leaving its files out.
    venv = tmp_path / "hidden_bulk" / ".venv" / "lib"
    venv.mkdir(parents=True)
    for index in range(30):
        (venv / f"module{index}.py").write_text("")
    (tmp_path / "hidden_bulk" / "README.md").write_text("# a project\n")
    assert "a directory of over 20 entries" in error_of(capsys, tmp_path / "hidden_bulk")


def test_what_a_dataset_folder_holds_is_found_past_other_files(tmp_path, monkeypatch):
    """The hub's data/ and split folders are looked in first (a folder of many images at the top spends no budget
    there); a README that declares configs is trusted with a byte order mark too; a README that is a FIFO is not
    read (it would block); a small tree is handed to `datasets` whatever its layout (nested splits, text files)."""
    from rollout.eval import dataset_folder

    monkeypatch.setattr(dataset_folder, "MAX_SCANNED", 20)
    images = tmp_path / "images"
    (images / "data").mkdir(parents=True)
    for index in range(30):
        (images / f"{index}.png").write_bytes(b"")
    (images / "data" / "train.jsonl").write_text('{"question": "q"}\n')
    dataset_folder.check_dataset_folder(str(images), "images")
    carded = tmp_path / "carded"
    carded.mkdir()
    for index in range(30):
        (carded / f"{index}.bin").write_bytes(b"")
    (carded / "README.md").write_bytes("\ufeff---\nconfigs:\n- config_name: default\n---\n".encode())
    dataset_folder.check_dataset_folder(str(carded), "carded")
    os.remove(carded / "README.md")
    os.mkfifo(carded / "README.md")
    with pytest.raises(DatasetError, match="over 20 entries"):
        dataset_folder.check_dataset_folder(str(carded), "carded")
    nested = tmp_path / "nested"
    (nested / "train" / "en" / "2024").mkdir(parents=True)
    (nested / "train" / "en" / "2024" / "a.txt").write_text("hello\n")
    dataset_folder.check_dataset_folder(str(nested), "nested")  # a small tree: datasets reads it itself


@pytest.mark.parametrize(
    "place",
    [
        "test.jsonl",
        "train/part.parquet",
        "data/train-00000-of-00001.parquet",
        "data/test/rows.csv.gz",
        "default/train/0000.parquet",  # the hub's Parquet conversion (refs/convert/parquet)
    ],
)
def test_a_dataset_directory_with_data_files_where_the_hub_puts_them_is_read(capsys, tmp_path, place):
    """A data file at the top level, in a split folder, in data/ or in data/<split>/ (compressed too) passes the
    check and is read by `datasets` (its own split naming: a "test" file is the test split)."""
    import gzip

    folder = tmp_path / "dataset"
    path = folder / place
    path.parent.mkdir(parents=True)
    rows = [{"question": "What is 2+2?", "answer": "4"}, {"question": "What is 3+3?", "answer": "6"}]
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".gz":
        path.write_bytes(gzip.compress(b"question,answer\nWhat is 2+2?,4\nWhat is 3+3?,6\n"))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    from rollout.eval.dataset import load_rows

    split = "test" if "test" in place else "train"
    assert [row["question"] for row in load_rows(str(folder), split, None)] == [row["question"] for row in rows]


@pytest.mark.parametrize(
    "split, expected",
    [
        ("train[1:]", "row 1 of {path} --split train[1:] has no such field"),
        ("train[-1:]", "{path} --split train[-1:] has no such field; its fields are: question"),
    ],
)
def test_a_missing_field_under_a_sliced_split_names_the_split_not_the_files_row(capsys, tmp_path, split, expected):
    """A slice's row 1 is not the file's row 1 (whose answer is there), and the file has the field the slice's rows
    lack: the message names the split whose rows it counts."""
    path = tmp_path / "rows.jsonl"
    rows = [{"question": "a", "answer": "1"}, {"question": "b", "answer": "1"}, {"question": "c"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    message = error_of(capsys, path, "--answer-field", "answer", "--split", split)
    assert message == "--answer-field answer: " + expected.format(path=path)


def test_a_rows_fault_under_a_sliced_split_says_where_its_rows_count_from(capsys, tmp_path):
    """An empty prompt or a missing answer names its row as the output's prompt_index, the slice's: row 1 of
    train[1:] is the file's row 2, whose prompt is empty; the message says so. A file's own fault names its line."""
    path = tmp_path / "rows.jsonl"
    rows = [{"question": "a", "answer": "1"}, {"question": "b", "answer": "1"}, {"question": "", "answer": None}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    message = error_of(capsys, path, "--split", "train[1:]")
    assert (
        message == "--prompt-field question: row 1 has an empty prompt (rows count from the first of --split train[1:])"
    )
    message = error_of(capsys, path, "--answer-field", "answer", "--split", "train[1:]")
    assert message.startswith("--answer-field answer: row 1 has no answer") and message.endswith(
        "(rows count from the first of --split train[1:])"
    )
    path.write_text(path.read_text() + "{not json\n")
    assert "(rows count" not in error_of(capsys, path, "--split", "train[1:]")
