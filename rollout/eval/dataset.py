"""`rollout-eval --dataset`: rows from a local JSONL / JSON, CSV or Parquet file, a local dataset directory, or a
`datasets` hub dataset (`name[:config]`).

Local files are read as written (`file_rows.py`: JSON values keep their types, CSV fields stay strings), regular files
only, line by line with a limit on each line's length; a malformed line is named. Directories and hub datasets go
through `datasets.load_dataset`. Every source takes the same `--split` (a file has one split, "train"; `datasets`
slicing such as "train[:100]" or "test[:10%]" works on all).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from rollout.cli.hub import check_hub_source, first_line, is_local_path
from rollout.eval.dataset_folder import check_dataset_folder
from rollout.eval.file_rows import DatasetError, read_file_rows
from rollout.eval.files import DEFAULT_MAX_LINE_CHARS, FileRefused, check_regular

__all__ = ["DatasetError", "check_fields", "load_rows"]

READERS = (".jsonl", ".json", ".csv", ".parquet")
# Endings that mark a name as a file the user meant (not a hub id), even one rollout-eval cannot read.
FILE_LIKE = (*READERS, ".txt", ".tsv", ".arrow", ".xlsx", ".xls", ".gz", ".zip", ".md")
# The split read when --split is not given: a file has one ("train", as `datasets` names it); on the hub, evaluation
# sets are conventionally the "test" split.
DEFAULT_FILE_SPLIT, DEFAULT_HUB_SPLIT = "train", "test"


def load_rows(
    dataset: str, split: str | None, num_samples: int | None, max_line_chars: int = DEFAULT_MAX_LINE_CHARS
) -> list[dict[str, Any]]:
    """The first `num_samples` rows (all when None) of `dataset`'s `split`.

    Args:
        dataset: a local .jsonl / .json / .csv / .parquet file, a local dataset directory (as the hub holds
            datasets; "directory:config" picks a config), or a hub dataset as "name" or "name:config".
        split: the split to read (None: "train" for a file or directory, "test" for a hub dataset), with `datasets`
            slicing ("test[:100]", "train[10%:20%]").
        num_samples: how many rows from the start of the split (None: all).
        max_line_chars: the longest line of a local JSONL or CSV file read, in characters (a longer one is refused
            at once, naming its line).
    Raises:
        DatasetError: no such file, a directory with no data file where a dataset directory holds them, a path that is not a regular file (a FIFO, a device), an unknown file type, a
            malformed or over-long line, an unknown split, no rows, or a hub dataset this machine cannot get.
    """
    folder, _, folder_config = dataset.partition(":")
    path = os.path.expanduser(dataset)
    if os.path.isdir(os.path.expanduser(folder)):  # e.g. what `hf download --repo-type dataset` fetched
        check_dataset_folder(os.path.expanduser(folder), dataset)  # datasets would glob its whole tree
        rows = _load_with_datasets(dataset, dict(path=os.path.expanduser(folder), name=folder_config or None), split)
    elif is_local_path(dataset) or os.path.splitext(dataset)[1].lower() in FILE_LIKE:
        try:
            if not check_regular(path):
                raise DatasetError(f"--dataset {dataset}: no such file")
        except FileRefused as error:
            raise DatasetError(
                f"--dataset {dataset}: {error}; save the rows to a file ({', '.join(READERS)}) and pass that"
            ) from None
        ending = os.path.splitext(path)[1].lower()
        if ending not in READERS:
            raise DatasetError(f"--dataset {dataset}: expected a file ending in {', '.join(READERS)}")
        rows = _slice(read_file_rows(dataset, path, ending, max_line_chars), split or DEFAULT_FILE_SPLIT, dataset)
    else:
        name, _, config = dataset.partition(":")
        cached_only = check_hub_source(name, "--dataset", repo_type="dataset", config=config or None)
        with _offline(cached_only):
            rows = _load_with_datasets(dataset, dict(path=name, name=config or None), split or DEFAULT_HUB_SPLIT)
    if not rows:
        raise DatasetError(f"--dataset {dataset}: no rows{'' if split is None else f' in split {split}'}")
    return rows[:num_samples] if num_samples is not None else rows


def _slice(rows: list[dict[str, Any]], split: str, dataset: str) -> list[dict[str, Any]]:
    """The rows a `datasets` split instruction over a file's one split ("train") selects."""
    import datasets

    try:
        instructions = datasets.ReadInstruction.from_spec(split).to_absolute({DEFAULT_FILE_SPLIT: len(rows)})
    except (ValueError, AssertionError) as error:
        raise DatasetError(
            f"--split {split}: a file has one split, {DEFAULT_FILE_SPLIT} (slices such as train[:100] work): "
            f"{first_line(error)}"
        ) from None
    return [row for instruction in instructions for row in rows[instruction.from_ : instruction.to]]


def _load_with_datasets(dataset: str, loader: dict[str, Any], split: str | None) -> list[dict[str, Any]]:
    """Rows through `datasets.load_dataset`, its errors as one line."""
    import datasets

    datasets.disable_progress_bars()  # rollout-eval's own bar is the one that matters
    split = split or DEFAULT_FILE_SPLIT
    try:
        return datasets.load_dataset(**loader, split=split).to_list()
    except ValueError as error:  # an unknown split or config, an empty slice
        if "corresponds to no data" in str(error):
            return []
        raise DatasetError(f"--dataset {dataset} --split {split}: {first_line(error)}") from None
    except Exception as error:  # not found, unreachable, malformed: datasets' own error types
        # A file that fails to parse is DatasetGenerationError's cause: its own text, "An error occurred while
        # generating the dataset", names nothing.
        cause = error.__cause__ if isinstance(error, datasets.exceptions.DatasetGenerationError) else None
        reason = first_line(error) if cause is None else f"{type(cause).__name__}: {first_line(cause)}"
        raise DatasetError(f"--dataset {dataset}: cannot be read ({reason})") from None


@contextlib.contextmanager
def _offline(on: bool) -> Iterator[None]:
    """While loading, `datasets` and the hub client read only the local cache (when `on`): the hub was found
    unreachable, so any request would only retry for a minute."""
    if not on:
        yield
        return
    import datasets
    from huggingface_hub import constants

    before = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = before


def check_fields(rows: list[dict[str, Any]], dataset: str, **flags: str | None) -> None:
    """Every field a flag names exists in the rows.

    Args:
        rows: the dataset's rows.
        dataset: the dataset as given, for the message.
        **flags: flag name -> the field it names (None: not given), e.g. prompt_field="question".
    Raises:
        DatasetError: naming the flag and listing the fields that do exist.
    """
    columns = list(rows[0]) if rows else []
    for flag, field in flags.items():
        if field is not None and field not in columns:
            raise DatasetError(
                f"--{flag.replace('_', '-')} {field}: {dataset} has no such field; its fields are: "
                f"{', '.join(columns) or '(none: it has no rows)'}"
            )
        missing = next((index for index, row in enumerate(rows) if field is not None and field not in row), None)
        if missing is not None:
            raise DatasetError(f"--{flag.replace('_', '-')} {field}: row {missing} of {dataset} has no such field")
