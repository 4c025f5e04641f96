"""Reading a file that someone else named (a client's Restore path, a snapshot in the state
directory, a table a parameter names): it must be a regular file, it is opened without
blocking and read with a size cap. A FIFO would block the reader until a writer came, a
symbolic link to /dev/zero would be read until memory ran out."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class FileRefusedError(OSError):
    """A file that is not a regular one, or larger than the reader takes."""


def read_regular_file(path: str | Path, max_bytes: int) -> bytes:
    """The content of the regular file at ``path`` (symbolic links followed), at most
    ``max_bytes`` long; FileRefusedError for anything else, OSError when it cannot be read."""
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefusedError(f"{path} is not a regular file ({_kind(info.st_mode)})")
        if info.st_size > max_bytes:
            raise FileRefusedError(_too_large(path, max_bytes))
        # One byte more than allowed tells a file that grew past the cap since fstat.
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise FileRefusedError(_too_large(path, max_bytes))
    return data


def _too_large(path: str | Path, max_bytes: int) -> str:
    return f"{path} is larger than {max_bytes:,} bytes, the most read of such a file"


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a plain file"
