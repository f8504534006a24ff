"""`rollout-eval` on hostile files: each is refused with one line naming the file, the line (or row) and what is wrong,
exit status 2, no traceback, never a hang and never memory in proportion to the file: a 50 MB line, bytes that are not
UTF-8, a lone surrogate, a FIFO or device as the dataset or as --output. The hang tests run under a timeout (a
subprocess's, or pytest-timeout's), so a regression fails instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout.eval import files
from rollout.eval.cli import main
from rollout.eval.files import FileRefused

REPO_DATASET = Path(__file__).resolve().parents[1] / "examples" / "data" / "arithmetic.jsonl"
TINY = ["--model", "tiny", "--max-new-tokens", "1"]
REPO = ["--dataset", REPO_DATASET, "--prompt-field", "question"]
# Run in a child: the heavy imports first, then the kernel's cap on the address space (a regression then fails at once
# instead of taking the machine's memory), then rollout-eval, its peak RSS growth and time printed as JSON.
BOUNDED_CHILD = """
import json, resource, sys, time
import rollout.eval.session
from rollout.eval.cli import main
with open("/proc/self/statm") as file:
    size = int(file.read().split()[0]) * resource.getpagesize()
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
cap = size + (3 << 30) if hard == resource.RLIM_INFINITY else min(size + (3 << 30), hard)
resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
before, started = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
status = main(sys.argv[1:])
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps(dict(status=status, grown_mb=grown / 1024, seconds=time.perf_counter() - started)))
"""


def error_of(capsys, flags: list) -> str:
    """rollout-eval's stderr for `flags`, checked to be one error line with exit status 2 and no traceback."""
    assert main([str(flag) for flag in flags]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rollout-eval: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0].removeprefix("rollout-eval: error: ")


def test_a_50_mb_line_is_refused_at_once_in_bounded_memory_keeping_the_output(tmp_path):
    dataset, output = tmp_path / "rows.jsonl", tmp_path / "rows.out.jsonl"
    with dataset.open("w") as file:
        file.write('{"prompt": "2 + 2 ="}\n')
        file.write(json.dumps({"prompt": "x" * (50 << 20)}) + "\n")
        file.write('{"prompt": "3 + 3 ="}\n')
    output.write_text("a previous run's rows\n")
    flags = [*TINY, "--device", "cpu", "--dataset", dataset, "--output", output]  # cpu: CUDA maps much address space
    child = subprocess.run(
        [sys.executable, "-c", BOUNDED_CHILD, *map(str, flags)], capture_output=True, text=True, timeout=280
    )
    assert child.stdout and "Traceback" not in child.stderr, child.stderr[-2000:]
    result = json.loads(child.stdout.splitlines()[-1])
    assert result["status"] == 2
    assert f"--dataset {dataset}: line 2 is longer than 4,194,304 characters" in child.stderr
    assert "raise --max-line-chars" in child.stderr
    assert result["grown_mb"] < 200, result  # the line is never held whole (before: 19 GB)
    assert result["seconds"] < 60, result  # a generous bound (before: 1 min 50 s); it takes well under a second
    assert output.read_text() == "a previous run's rows\n"  # nothing written is lost


def test_the_limit_is_a_flag(capsys, tmp_path):
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text('{"prompt": "2 + 2 ="}\n' + json.dumps({"prompt": "x" * 100}) + "\n")
    message = error_of(capsys, [*TINY, "--dataset", dataset, "--max-line-chars", 50])
    assert message.startswith(f"--dataset {dataset}: line 2 is longer than 50 characters (the limit, ")
    assert main([str(flag) for flag in [*TINY, "--dataset", dataset, "--max-line-chars", 200]]) == 0
    assert (
        error_of(capsys, [*TINY, "--dataset", dataset, "--max-line-chars", 0])
        == "--max-line-chars 0: must be at least 1"
    )


def test_a_prompt_over_the_limit_from_a_file_read_whole_is_refused_before_tokenizing(capsys, tmp_path):
    dataset = tmp_path / "rows.json"
    dataset.write_text(json.dumps([{"prompt": "2 + 2 ="}, {"prompt": "x" * 100}]))
    message = error_of(capsys, [*TINY, "--dataset", dataset, "--max-line-chars", 50])
    assert message == (
        "--prompt-field prompt: row 1 holds a prompt of 100 characters, over --max-line-chars 50; shorten or leave "
        "out such rows, or raise --max-line-chars"
    )


# Files with text that is not text: each named with its line (or row) and field.
NOT_TEXT = {
    "surrogate.jsonl": (
        '{"prompt": "2 + 2 ="}\n{"prompt": "\\ud800"}\n',
        "line 2 (row 1), field prompt: holds a lone surrogate",
    ),
    "chat.jsonl": (
        '{"prompt": [{"role": "user", "content": "a\\udc00"}]}\n',
        "line 1 (row 0), field prompt[0].content: holds",
    ),
    "key.jsonl": ('{"prompt": "a", "\\ud800": 1}\n', "line 1 (row 0): the field name '\\ud800' holds a lone surrogate"),
    "surrogate.json": ('[{"prompt": "a"}, {"prompt": "\\udfff"}]', "row 1, field prompt: holds a lone surrogate"),
    "binary.jsonl": (b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n', "line 2 is not UTF-8 text"),
    "binary.csv": (b"prompt\nok\n\x89PNG\r\n\x1a\n", "line 3 is not UTF-8 text"),
    "nested.jsonl": (
        '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
        "line 1 (row 0) is nested too deeply to read",
    ),
}


@pytest.mark.parametrize("name", sorted(NOT_TEXT))
def test_text_that_is_not_text_is_named_by_line_and_field(capsys, tmp_path, name):
    content, expected = NOT_TEXT[name]
    dataset = tmp_path / name
    dataset.write_bytes(content if isinstance(content, bytes) else content.encode())
    message = error_of(capsys, [*TINY, "--dataset", dataset])
    assert message.startswith(f"--dataset {dataset}: {expected}"), message


def test_a_binary_file_without_newlines_is_refused_at_the_limit(capsys, tmp_path):
    dataset = tmp_path / "blob.jsonl"
    dataset.write_bytes(os.urandom(1 << 20))
    message = error_of(capsys, [*TINY, "--dataset", dataset, "--max-line-chars", 1000])
    assert message.startswith(f"--dataset {dataset}: line ")  # too long, or not UTF-8, whichever comes first


def test_a_csv_quote_left_open_is_bounded_by_the_limit(capsys, tmp_path):
    dataset = tmp_path / "rows.csv"
    dataset.write_text('prompt\n"never closed\n' + "more text\n" * 100)
    message = error_of(capsys, [*TINY, "--dataset", dataset, "--max-line-chars", 200])
    assert message.startswith(f"--dataset {dataset}: line ") and "a field is longer than 200 characters" in message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/null", "link-to-a-device"])
def test_a_dataset_that_is_no_regular_file_is_refused_without_reading(capsys, tmp_path, kind):
    if kind == "fifo":
        dataset = tmp_path / "rows.jsonl"
        os.mkfifo(dataset)
        expected = "is a FIFO (named pipe), not a regular file"
    elif kind == "link-to-a-device":  # a link to a device, named like a dataset file
        dataset = tmp_path / "rows.jsonl"
        dataset.symlink_to("/dev/zero")
        expected = "is a character device, not a regular file"
    else:
        dataset, expected = Path(kind), "is a character device, not a regular file"
    message = error_of(capsys, [*TINY, "--dataset", dataset])
    assert (
        message
        == f"--dataset {dataset}: {expected}; save the rows to a file (.jsonl, .json, .csv, .parquet) and pass that"
    )


def test_a_fifo_output_is_refused_promptly(tmp_path):
    """In a subprocess with a timeout: the FIFO had no reader, so opening it to write would wait forever."""
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    started = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-m", "rollout.eval", *TINY, *map(str, REPO), "--output", str(fifo)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert child.returncode == 2 and "Traceback" not in child.stderr, child.stderr
    assert (
        f"--output {fifo} is a FIFO (named pipe), not a regular file; name a regular file or a new path" in child.stderr
    )
    assert time.perf_counter() - started < 200  # refused before anything loads; the bound is only generous


@pytest.mark.timeout(60)
def test_an_output_whose_summary_path_is_no_regular_file_is_refused(capsys, tmp_path):
    output = tmp_path / "rows.jsonl"
    os.mkfifo(f"{output}.summary.json")
    message = error_of(capsys, [*TINY, *REPO, "--output", output])
    assert message.startswith(f"--output {output}: its summary file {output}.summary.json is a FIFO (named pipe)")
    message = error_of(capsys, [*TINY, *REPO, "--output", "/dev/null"])
    assert message.startswith("--output /dev/null is a character device, not a regular file")


@pytest.mark.timeout(60)
def test_files_are_opened_without_blocking_and_checked_on_the_descriptor(tmp_path, monkeypatch):
    """A FIFO made after rollout-eval's checks (the check by name passes): opening it neither waits for a writer nor
    for a reader, and the open descriptor is refused."""
    fifo = tmp_path / "made-later"
    os.mkfifo(fifo)
    monkeypatch.setattr(files, "check_regular", lambda path: False)
    with pytest.raises(FileRefused, match="is a FIFO"):
        files.open_for_reading(str(fifo))
    with pytest.raises(OSError):  # no reader: ENXIO at once
        files.open_for_writing(str(fifo))
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(FileRefused, match="is a FIFO"):  # a reader: opened, then refused on the descriptor
            files.open_for_writing(str(fifo))
    finally:
        os.close(reader)
    regular = tmp_path / "rows.jsonl"
    with files.open_for_writing(str(regular)) as file:
        file.write("é\n")
    with files.open_for_reading(str(regular)) as file:
        assert file.read() == "é\n".encode()
