"""`rollout-eval --dataset DIR`: a large directory is handed to `datasets` only if it holds data files where dataset
layouts put them.

`datasets.load_dataset(path=DIR)` resolves a local folder by globbing its whole tree (its last default pattern is
"**"): on a home directory or a checkout that took minutes, then read whatever files it found as rows. So before
handing a directory over, a bounded scan looks for a data file of the kinds `datasets` reads as rows (JSON lines,
JSON, CSV/TSV, Parquet, Arrow; compressed too; text files in a split's place) where `hf download --repo-type dataset`
leaves them: at the top level, in a folder one level down (a split or config folder: `train/`, `main/`, `data/`), in
one below `data/` (`data/train/`), or in a split folder within one (`default/train/`, the hub's Parquet conversion).
A README whose YAML header declares `configs` names its own files, and is trusted as written. A directory of fewer
than `MAX_SCANNED` entries in all is handed over whatever its layout: `datasets` globs it at once, and says itself
if it holds no rows.
"""

from __future__ import annotations

import os
import re

from rollout.eval.file_rows import DatasetError

__all__ = ["MAX_SCANNED", "check_dataset_folder"]

# Endings of the files `datasets` reads as rows (its packaged json, csv, parquet and arrow builders).
DATA_ENDINGS = (".jsonl", ".json", ".ndjson", ".csv", ".tsv", ".parquet", ".geoparquet", ".gpq", ".arrow")
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")
# Files `datasets` never reads as rows (data_files.FILES_TO_IGNORE).
NOT_DATA = {"config.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}
# Names `datasets` reads as splits (its data_files.SPLIT_KEYWORDS, then a separator or digits: train_v2,
# validation-00): such a folder is looked into one level deeper too, and a text file so named is data.
SPLIT_NAME = re.compile(r"(train|training|validation|valid|dev|val|test|testing|eval|evaluation)([-._ 0-9].*)?$")
# The most directory entries the scan looks at before it gives up (a real dataset's first data file comes far sooner).
MAX_SCANNED = 10_000
README_HEAD_CHARS = 65_536


def check_dataset_folder(folder: str, dataset: str) -> None:
    """Refuses at once a large directory holding no data file where a dataset directory holds them (module docstring).

    Args:
        folder: the directory (user's home expanded).
        dataset: `--dataset` as given, for the message.
    Raises:
        DatasetError: naming `--dataset` and the places and file kinds looked for, or why it cannot be read.
    """
    try:
        with os.scandir(folder):
            pass
    except OSError as error:
        raise DatasetError(f"--dataset {dataset}: the directory cannot be read ({error.strerror})") from None
    if _readme_declares_configs(folder):
        return
    budget = [MAX_SCANNED]
    # Where the hub layout puts data first (a folder of many other files at the top could spend the budget).
    known = [name for name in ("data", "train", "test", "validation") if os.path.isdir(os.path.join(folder, name))]
    if any(_has_data(os.path.join(folder, name), [MAX_SCANNED], 1, 1, name != "data") for name in known):
        return
    if _has_data(folder, budget, depth=1, data_depth=2) or _fewer_entries_than(folder, MAX_SCANNED):
        return
    raise DatasetError(
        f"--dataset {dataset}: a directory of over {MAX_SCANNED:,} entries with no data file ({', '.join(DATA_ENDINGS)}"
        ", compressed too) at its top level, in a folder one level down (train/, data/), in data/*/ or */train/, "
        "where `datasets` would search the whole tree for minutes; give a dataset directory (as `hf download "
        "--repo-type dataset` leaves it) or a data file"
    )


def _has_data(folder: str, budget: list[int], depth: int, data_depth: int, in_split: bool = False) -> bool:
    """Whether `folder` holds a data file, or (within `depth` levels; `data_depth` under a folder named data; a split's
    folder always) one of its visible subfolders does. Each entry looked at spends one of `budget`. `in_split`: the
    folder is a split's (its text files are rows)."""
    subfolders = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                budget[0] -= 1
                if budget[0] < 0:
                    return False
                if entry.name.startswith((".", "__")):  # datasets skips hidden and dunder names too
                    continue
                try:
                    if entry.is_file() and _is_data_file(entry.name, in_split):
                        return True
                    if entry.is_dir():
                        subfolders.append(entry)
                except OSError:
                    continue
    except OSError:  # unreadable below the top: datasets would fail on it too, with its own message
        return False
    for entry in subfolders:
        split = SPLIT_NAME.match(entry.name.lower()) is not None
        levels = data_depth if entry.name == "data" else depth
        if split:  # a split's folder in a config's (default/train/)
            levels = max(levels, 1)
        if levels > 0 and _has_data(entry.path, budget, levels - 1, levels - 1, in_split or split):
            return True
    return False


def _fewer_entries_than(folder: str, limit: int) -> bool:
    """Whether the tree under `folder` has fewer than `limit` entries, counted breadth first and stopping at the
    limit (symbolic links to folders not followed). Hidden entries count: `datasets` leaves their files out of the
    dataset, but only after its glob walked them (a checkout's .venv and .git: minutes)."""
    pending, seen = [folder], 0
    while pending:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    seen += 1
                    if seen >= limit:
                        return False
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
        except OSError:
            continue
    return True


def _is_data_file(name: str, in_split: bool = False) -> bool:
    """Whether a file of this name is one `datasets` reads as rows: a data file, or a text file in a split's folder or
    named as a split (train.txt; not a checkout's requirements.txt)."""
    if name in NOT_DATA:
        return False
    stem, ending = os.path.splitext(name.lower())
    if ending in COMPRESSED:
        stem, ending = os.path.splitext(stem)
    if ending == ".txt":
        return in_split or SPLIT_NAME.match(stem) is not None
    return ending in DATA_ENDINGS


def _readme_declares_configs(folder: str) -> bool:
    """Whether the folder's README.md opens with a YAML header that has a top-level `configs` key (a dataset card
    naming its data files, wherever they are)."""
    path = os.path.join(folder, "README.md")
    if not os.path.isfile(path):  # (a FIFO would block the read)
        return False
    try:
        with open(path, encoding="utf-8-sig", errors="replace") as file:  # -sig: a byte order mark dropped
            head = file.read(README_HEAD_CHARS)
    except OSError:
        return False
    if not head.startswith("---"):
        return False
    header = head[3:].split("\n---", 1)[0]
    return any(line.startswith("configs:") for line in header.splitlines())
