"""Large byte strings copied by the kernel, outside the GIL.

``b"".join`` of a reply of tens of MB is one memcpy that holds the GIL throughout, and
the event loop that answers every engine waits for it. ``os.write`` and ``os.pread``
release the GIL around their system call, so bytes that pass through an anonymous
memory file are copied while the loop runs.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence

# Below this a join holds the GIL for microseconds: not worth a file.
JOIN_IN_FILE_BYTES = 1 << 20


def memory_file(name: str) -> int:
    """A file descriptor of an anonymous file (in memory where the system has memfd)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, os.MFD_CLOEXEC)
    handle = tempfile.TemporaryFile()  # noqa: SIM115 - its descriptor outlives it (dup)
    try:
        return os.dup(handle.fileno())
    finally:
        handle.close()


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_all(fd: int, size: int) -> bytes:
    """The first ``size`` bytes of the file ``fd`` (one allocation, filled by the kernel)."""
    data = os.pread(fd, size, 0)
    if len(data) == size:
        return data
    parts = [data]  # a read may stop short (very large files); rare, so joined as usual
    done = len(data)
    while done < size:
        part = os.pread(fd, size - done, done)
        if not part:
            raise OSError(f"the file ended at {done:,} of {size:,} bytes")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


def joined(parts: Sequence[bytes]) -> bytes:
    """``b"".join(parts)``, copied outside the GIL when large."""
    size = sum(map(len, parts))
    if size < JOIN_IN_FILE_BYTES:
        return b"".join(parts)
    fd = memory_file("nightjar-join")
    try:
        for part in parts:
            write_all(fd, part)
        return read_all(fd, size)
    finally:
        os.close(fd)
