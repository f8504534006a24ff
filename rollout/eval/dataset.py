"""`rollout-eval --dataset`: rows from a local JSONL / JSON, CSV or Parquet file, or a `datasets` hub dataset
(`name[:config]`), all read through `datasets.load_dataset` so a file and a hub dataset behave the same."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from rollout.hub import check_hub_source, first_line, is_local_path

# File endings -> the `datasets` builder that reads them.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
# The split read when --split is not given: a file has one ("train", as `datasets` names it); on the hub, evaluation
# sets are conventionally the "test" split.
DEFAULT_FILE_SPLIT, DEFAULT_HUB_SPLIT = "train", "test"


class DatasetError(ValueError):
    """A dataset that cannot be read as asked; the message names the flag and says what to do."""


def load_rows(dataset: str, split: str | None, num_samples: int | None) -> list[dict[str, Any]]:
    """The first `num_samples` rows (all when None) of `dataset`'s `split`.

    Args:
        dataset: a local .jsonl / .json / .csv / .parquet file, a local dataset directory (as the hub holds
            datasets; "directory:config" picks a config), or a hub dataset as "name" or "name:config".
        split: the split to read (None: "train" for a file or directory, "test" for a hub dataset); `datasets`
            slicing such as "test[:100]" works too.
        num_samples: how many rows from the start of the split (None: all).
    Raises:
        DatasetError: no such file, an unknown file type, an unknown split, or a hub dataset this machine cannot get.
    """
    import datasets

    datasets.disable_progress_bars()  # rollout-eval's own bar is the one that matters
    cached_only = False
    folder, _, folder_config = dataset.partition(":")
    if os.path.isdir(os.path.expanduser(folder)):  # e.g. what `hf download --repo-type dataset` fetched
        split = split or DEFAULT_FILE_SPLIT
        loader: dict[str, Any] = dict(path=os.path.expanduser(folder), name=folder_config or None)
    elif is_local_path(dataset) or os.path.splitext(dataset)[1].lower() in FILE_BUILDERS:
        path = os.path.expanduser(dataset)
        if not os.path.isfile(path):
            raise DatasetError(f"--dataset {dataset}: no such file")
        builder = FILE_BUILDERS.get(os.path.splitext(path)[1].lower())
        if builder is None:
            raise DatasetError(f"--dataset {dataset}: expected a file ending in {', '.join(FILE_BUILDERS)}")
        split = split or DEFAULT_FILE_SPLIT
        loader = dict(path=builder, data_files=path)
    else:
        name, _, config = dataset.partition(":")
        cached_only = check_hub_source(name, "--dataset", repo_type="dataset")
        split = split or DEFAULT_HUB_SPLIT
        loader = dict(path=name, name=config or None)
    try:
        with _offline(cached_only):
            rows = datasets.load_dataset(**loader, split=split)
    except ValueError as error:  # an unknown split; a config that does not exist
        raise DatasetError(f"--dataset {dataset} --split {split}: {first_line(error)}") from None
    except (OSError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as error:
        raise DatasetError(f"--dataset {dataset}: {first_line(error)}") from None
    except Exception as error:  # a malformed file: datasets raises its own DatasetGenerationError and friends
        raise DatasetError(f"--dataset {dataset}: cannot be read ({first_line(error)})") from None
    if num_samples is not None:
        rows = rows.select(range(min(num_samples, len(rows))))
    return rows.to_list()


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
