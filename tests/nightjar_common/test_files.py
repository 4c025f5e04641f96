"""read_regular_file: a file someone else named is read only when it is a regular file, never
blocks (a FIFO), and is never read past its cap (a huge file, a link to /dev/zero)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from nightjar_common.files import FileRefusedError, read_regular_file


def read_within(path: Path, max_bytes: int, seconds: float = 5.0) -> bytes | BaseException:
    """What read_regular_file returns or raises, failing the test if it blocks."""
    result: list[bytes | BaseException] = []

    def run() -> None:
        try:
            result.append(read_regular_file(path, max_bytes))
        except BaseException as exc:  # handed to the test
            result.append(exc)

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    reader.join(seconds)
    assert result, f"reading {path} blocked"
    return result[0]


def test_a_regular_file_within_the_cap_is_read(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_bytes(b"x" * 100)
    assert read_regular_file(path, 100) == b"x" * 100
    os.symlink(path, tmp_path / "link")  # a link to a regular file is followed
    assert read_regular_file(tmp_path / "link", 100) == b"x" * 100


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = read_within(fifo, 1 << 20)
    assert isinstance(result, FileRefusedError) and "is not a regular file (a FIFO)" in str(result)


def test_a_link_to_dev_zero_and_a_directory_are_refused(tmp_path: Path) -> None:
    os.symlink("/dev/zero", tmp_path / "zero")
    result = read_within(tmp_path / "zero", 1 << 20)
    assert isinstance(result, FileRefusedError) and "(a character device)" in str(result)
    result = read_within(tmp_path, 1 << 20)
    assert isinstance(result, FileRefusedError) and "(a directory)" in str(result)


def test_a_file_over_the_cap_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with big.open("wb") as fh:
        fh.truncate(300 << 20)  # sparse: 300 MB that take no disk
    started = time.perf_counter()
    with pytest.raises(FileRefusedError, match="is larger than 67,108,864 bytes"):
        read_regular_file(big, 64 << 20)
    assert time.perf_counter() - started < 1.0, "refused from its size, not read"
    with pytest.raises(FileRefusedError, match="larger than 99 bytes"):
        read_regular_file(tmp_path / "big.json", 99)
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "missing", 99)
