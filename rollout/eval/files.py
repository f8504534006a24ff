"""The local files `rollout-eval` reads (a dataset) and writes (its rows and summary), opened so that nothing can hang
or fill memory: only regular files are used (a FIFO, a device such as /dev/zero, a socket or a directory is refused
by name, before opening and again on the open descriptor, which is opened without blocking), and text is read line by
line with a limit on each line's length, so an over-long line is refused at the limit without ever being held whole.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO, TextIO

# The longest dataset line (and prompt) read by default, in characters: a 1M-token prompt is about 4M characters.
DEFAULT_MAX_LINE_CHARS = 4 << 20
# The UTF-8 byte order mark some editors write at a text file's start.
BOM = "\ufeff"


class FileRefused(ValueError):
    """A path that is not a regular file, or a line that cannot be read; the message says what is wrong with it (the
    caller puts the flag in front)."""


def kind_of(mode: int) -> str:
    """What a file of this `st_mode` is, in words ("a FIFO (named pipe)", "a character device", ...)."""
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for is_kind, name in kinds if is_kind(mode)), "not a regular file")


def check_regular(path: str) -> bool:
    """Whether `path` exists, refusing one that exists but is not a regular file (a symlink counts as its target).

    Args:
        path: the path, user-expanded.
    Raises:
        FileRefused: "is a FIFO (named pipe), not a regular file" and the like.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as error:
        raise FileRefused(f"cannot be looked at ({error.strerror or error})") from None
    if not stat.S_ISREG(mode):
        raise FileRefused(f"is {kind_of(mode)}, not a regular file")
    return True


def open_for_reading(path: str) -> BinaryIO:
    """`path` opened for reading as bytes, never blocking (a FIFO opens at once, and is then refused).

    Args:
        path: the path, user-expanded.
    Raises:
        FileRefused: the path is not a regular file.
        OSError: it cannot be opened (missing, no permission).
    """
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    return os.fdopen(_regular_only(descriptor), "rb")


def open_for_writing(path: str) -> TextIO:
    """`path` created or truncated for writing UTF-8 text, never blocking: a FIFO without a reader fails at once
    (ENXIO), one with a reader is refused, as is any other file that is not a regular one.

    Args:
        path: the path, user-expanded.
    Raises:
        FileRefused: the path is not a regular file.
        OSError: it cannot be opened (no such directory, no permission, a FIFO nobody reads).
    """
    check_regular(path)  # before opening: O_TRUNC must not touch anything else
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC
    return os.fdopen(_regular_only(os.open(path, flags, 0o666)), "w", encoding="utf-8")


def _regular_only(descriptor: int) -> int:
    """The descriptor, blocking again, if it is a regular file's; else closed and a FileRefused."""
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        raise FileRefused(f"is {kind_of(mode)}, not a regular file")
    os.set_blocking(descriptor, True)
    return descriptor


def read_lines(file: BinaryIO, max_chars: int, limit_flag: str) -> Iterator[tuple[int, str]]:
    """The file's lines as UTF-8 text (a leading byte order mark dropped), numbered from 1, each with its line ending
    ("\\n", "\\r\\n" or "\\r", as `open(newline="")` splits them); at most `max_chars` + 2 characters are ever held
    for a line.

    Args:
        file: the file, opened as bytes (`open_for_reading`).
        max_chars: the longest line allowed, in characters, line ending not counted.
        limit_flag: the flag that sets the limit, named in the error (e.g. "--max-line-chars").
    Raises:
        FileRefused: "line N is longer than ..." at the first over-long line, or "line N is not UTF-8 text".
    """
    # Undecodable bytes read as lone surrogates (which UTF-8 text never decodes to), so that a binary file is named
    # by its own line: a strict decoder would fail on the chunk read ahead, at an earlier line's number.
    text = io.TextIOWrapper(file, encoding="utf-8", errors="surrogateescape", newline="")
    number = 0
    while True:
        number += 1
        line = text.readline(max_chars + 2)  # room for "\r\n" after a line of exactly max_chars
        if not line:
            return
        if number == 1:  # a UTF-8 byte order mark (as Excel and Notepad write) is no part of the first field
            line = line.removeprefix(BOM)
        if len(line.rstrip("\r\n")) > max_chars:
            raise FileRefused(
                f"line {number} is longer than {max_chars:,} characters (the limit, {limit_flag} {max_chars}); "
                f"shorten or leave out such lines, or raise {limit_flag}"
            )
        if not line.isascii():
            try:
                line.encode("utf-8")
            except UnicodeEncodeError as error:
                raise FileRefused(
                    f"line {number} is not UTF-8 text (an undecodable byte at character {error.start + 1}): is it a "
                    "binary file?"
                ) from None
        yield number, line
