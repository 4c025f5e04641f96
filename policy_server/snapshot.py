"""Atomic snapshots of the learned state on disk.

A snapshot is one JSON document written to a temporary file in the same
directory, fsynced, then renamed over ``snapshot.json`` (and the directory
fsynced), so a crash at any moment leaves either the old or the new snapshot.
A snapshot that cannot be read is moved aside, never retried in a crash loop.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FORMAT = "nightjar-snapshot/1"
SNAPSHOT_NAME = "snapshot.json"


class SnapshotError(ValueError):
    """A snapshot document is unreadable or not a Nightjar snapshot."""


def write_atomic(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def parse(text: str | bytes, origin: str) -> dict[str, Any]:
    """Parse and check a snapshot document; SnapshotError says what is wrong."""
    try:
        document = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SnapshotError(f"{origin}: not valid JSON ({exc})") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise SnapshotError(f"{origin}: not a {FORMAT} document")
    policy = document.get("policy")
    if not isinstance(policy, dict) or not {"name", "params", "state"} <= set(policy):
        raise SnapshotError(f"{origin}: missing policy name/params/state")
    return document


def read(path: Path) -> dict[str, Any]:
    try:
        return parse(path.read_bytes(), str(path))
    except OSError as exc:
        raise SnapshotError(f"cannot read {path}: {exc}") from exc


def quarantine(path: Path) -> Path:
    """Move an unreadable snapshot aside so the next start does not trip on it again."""
    target = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
    os.replace(path, target)
    return target
