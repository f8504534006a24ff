"""`rollout-eval --dataset DIR`: a directory is a dataset only if it holds data files where the hub layout puts them.

`datasets.load_dataset(path=DIR)` resolves a local folder by globbing its whole tree (its last default pattern is
"**"): on a home directory or a checkout that took minutes, then read whatever files it found as rows. So before
handing a directory over, a bounded scan looks for a data file of the kinds `datasets` reads as rows (JSON lines,
JSON, CSV/TSV, Parquet, Arrow; compressed too) where `hf download --repo-type dataset` leaves them: at the top level,
in a folder one level down (a split or config folder: `train/`, `main/`, `data/`), or in one below `data/`
(`data/train/`), or in a split folder within one (`default/train/`, the hub's Parquet conversion). A README whose
YAML header declares `configs` names its own files, and is trusted as written.
"""

from __future__ import annotations

import os

from rollout.eval.file_rows import DatasetError

__all__ = ["MAX_SCANNED", "check_dataset_folder"]

# Endings of the files `datasets` reads as rows (its packaged json, csv, parquet and arrow builders).
DATA_ENDINGS = (".jsonl", ".json", ".ndjson", ".csv", ".tsv", ".parquet", ".geoparquet", ".gpq", ".arrow")
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")
# Files `datasets` never reads as rows (data_files.FILES_TO_IGNORE).
NOT_DATA = {"config.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}
# Folder names `datasets` reads as splits (its data_files.SPLIT_KEYWORDS), looked into one level deeper too.
SPLIT_FOLDERS = {"train", "training", "validation", "valid", "dev", "val", "test", "testing", "eval", "evaluation"}
# The most directory entries the scan looks at before it gives up (a real dataset's first data file comes far sooner).
MAX_SCANNED = 10_000
README_HEAD_CHARS = 65_536


def check_dataset_folder(folder: str, dataset: str) -> None:
    """Refuses at once a directory holding no data file where a dataset directory holds them.

    Args:
        folder: the directory (user's home expanded).
        dataset: `--dataset` as given, for the message.
    Raises:
        DatasetError: naming `--dataset` and the places and file kinds looked for.
    """
    if _readme_declares_configs(folder):
        return
    budget = [MAX_SCANNED]
    if _has_data(folder, budget, depth=1, data_depth=2):
        return
    cut = f" (it stopped after {MAX_SCANNED:,} entries)" if budget[0] < 0 else ""
    raise DatasetError(
        f"--dataset {dataset}: a directory with no data file ({', '.join(DATA_ENDINGS)}, compressed too) at its top "
        f"level, in a folder one level down (train/, data/), in data/*/ or */train/{cut}; give a dataset directory (as "
        "`hf download --repo-type dataset` leaves it) or a data file"
    )


def _has_data(folder: str, budget: list[int], depth: int, data_depth: int) -> bool:
    """Whether `folder` holds a data file, or (within `depth` levels; `data_depth` under a folder named data; a split's
    folder always) one of its visible subfolders does. Each entry looked at spends one of `budget`."""
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
                    if entry.is_file() and _is_data_file(entry.name):
                        return True
                    if entry.is_dir():
                        subfolders.append(entry)
                except OSError:
                    continue
    except OSError:  # unreadable: datasets would fail on it too, with its own message
        return False
    for entry in subfolders:
        levels = data_depth if entry.name == "data" else depth
        if entry.name.lower() in SPLIT_FOLDERS:  # a split's folder in a config's (default/train/)
            levels = max(levels, 1)
        if levels > 0 and _has_data(entry.path, budget, levels - 1, levels - 1):
            return True
    return False


def _is_data_file(name: str) -> bool:
    """Whether a file of this name is one `datasets` reads as rows."""
    if name in NOT_DATA:
        return False
    stem, ending = os.path.splitext(name.lower())
    if ending in COMPRESSED:
        ending = os.path.splitext(stem)[1]
    return ending in DATA_ENDINGS


def _readme_declares_configs(folder: str) -> bool:
    """Whether the folder's README.md opens with a YAML header that has a top-level `configs` key (a dataset card
    naming its data files, wherever they are)."""
    try:
        with open(os.path.join(folder, "README.md"), encoding="utf-8", errors="replace") as file:
            head = file.read(README_HEAD_CHARS)
    except OSError:
        return False
    if not head.startswith("---"):
        return False
    header = head[3:].split("\n---", 1)[0]
    return any(line.startswith("configs:") for line in header.splitlines())
