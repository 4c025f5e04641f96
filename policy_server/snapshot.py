"""Atomic snapshots of the learned state on disk.

A snapshot is one JSON document written to a temporary file in the same
directory, fsynced, then renamed over ``snapshot.json`` (and the directory
fsynced), so a crash at any moment leaves either the old or the new snapshot.
A snapshot that cannot be read is moved aside, never retried in a crash loop; temporary
files left by a writer that died half-way are removed at start (:func:`remove_leftovers`).

Paths that reach the server from a client (a snapshot to restore, a policy parameter
naming a file) are confined to the state directory (:func:`confine`): no RPC can make the
server read or write anywhere else.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from nightjar_common.files import read_regular_file
from nightjar_common.json_input import JsonError, load_json
from nightjar_common.validation import MAX_ID_LENGTH

log = logging.getLogger(__name__)

FORMAT = "nightjar-snapshot/1"
SNAPSHOT_NAME = "snapshot.json"
TEMP_PREFIX = f".{SNAPSHOT_NAME}."
TEMP_SUFFIX = ".tmp"
# The largest snapshot read (at start, or named by Restore), and so the most the writer
# writes (DecisionService.write_snapshot trims or refuses beyond it): a sidecar at its
# default bounds writes a few MB.
MAX_BYTES = 64 << 20
# The largest float magnitude of a state a client restores: learned statistics are
# decayed sums of per-step quantities (squared context tokens summed: ~1e21), and what a
# policy derives from them (products, squares, a solve) must stay finite for the next
# snapshot to be written: a step-time statistic of 1.7e308 overflows at the next step.
MAX_RESTORED_FLOAT = 1e60


class SnapshotError(ValueError):
    """A snapshot document is unreadable or not a Nightjar snapshot."""


def encode(document: dict[str, Any]) -> bytes:
    """The bytes :func:`write_atomic` writes for ``document``."""
    return encode_text(document).encode()


def encode_text(value: Any) -> str:
    """JSON as snapshots hold it: compact, no NaN or infinity (ValueError)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def write_atomic(path: Path, document: dict[str, Any]) -> None:
    write_bytes_atomic(path, encode(document))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` (an encoded document) as ``path``: old or new, never torn."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
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
    """Parse and check a snapshot document; SnapshotError says what is wrong. What a
    policy's ``load_state`` checks (its own state) is left to it."""
    try:
        document = load_json(text)
    except JsonError as exc:
        raise SnapshotError(f"{origin}: not valid JSON ({exc})") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise SnapshotError(f"{origin}: not a {FORMAT} document")
    policy = document.get("policy")
    if not isinstance(policy, dict) or not {"name", "params", "state"} <= set(policy):
        raise SnapshotError(f"{origin}: missing policy name/params/state")
    if not isinstance(policy["name"], str) or not all(
        isinstance(policy[key], dict) for key in ("params", "state")
    ):
        raise SnapshotError(f"{origin}: policy name must be a string, params and state objects")
    created = document.get("created_unix", 0.0)
    if isinstance(created, bool) or not isinstance(created, int | float) or created < 0:
        raise SnapshotError(f"{origin}: created_unix must be a number >= 0, got {created!r}")
    engines = document.get("engines", [])
    if not isinstance(engines, list) or not all(
        isinstance(e, str) and 0 < len(e) <= MAX_ID_LENGTH for e in engines
    ):
        raise SnapshotError(
            f"{origin}: engines must be a list of engine ids (1..{MAX_ID_LENGTH} characters)"
        )
    return document


def check_numbers(value: Any, where: str, limit: float = math.inf) -> None:
    """SnapshotError naming the first float in ``value`` (JSON data) that is not finite or
    of a magnitude above ``limit``, by its path from ``where``."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:  # iterative: JSON data is nested at most MAX_JSON_DEPTH levels anyway
        item, path = stack.pop()
        if isinstance(item, dict):
            stack.extend((child, (*path, str(key))) for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((child, (*path, index)) for index, child in enumerate(item))
        elif isinstance(item, float) and not (math.isfinite(item) and abs(item) <= limit):
            field = where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
            bound = "not finite" if limit == math.inf else f"beyond ±{limit:g}"
            raise SnapshotError(f"{field} is {item!r}, {bound}")


def read(path: Path) -> dict[str, Any]:
    """The snapshot document at ``path``: a regular file of at most MAX_BYTES."""
    try:
        return parse(read_regular_file(path, MAX_BYTES), str(path))
    except OSError as exc:
        raise SnapshotError(f"cannot read {path}: {exc}") from exc


def quarantine(path: Path) -> Path:
    """Move an unreadable snapshot aside so the next start does not trip on it again."""
    target = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
    os.replace(path, target)
    return target


def remove_leftovers(state_dir: Path) -> list[Path]:
    """Remove the temporary files of writers that were killed before their rename (they
    are never the current snapshot); returns what was removed."""
    removed: list[Path] = []
    try:
        candidates = list(state_dir.glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}"))
    except OSError:
        return removed
    for leftover in candidates:
        try:
            leftover.unlink()
        except OSError as exc:
            log.warning("cannot remove the leftover temporary file %s: %s", leftover, exc)
            continue
        removed.append(leftover)
    return removed


class OutsideStateDirError(ValueError):
    """A client-given path that lies outside the state directory (or there is none)."""


def confine(state_dir: Path | None, given: str) -> Path:
    """The real path of ``given`` (relative paths are taken from the state directory) when
    it lies inside ``state_dir``; OutsideStateDirError otherwise. Symbolic links are
    resolved first, so a link inside the directory cannot lead out of it."""
    if state_dir is None:
        raise OutsideStateDirError(
            f"{given!r}: the server has no state directory (--state-dir), so it reads no "
            "file named by a client"
        )
    root = state_dir.resolve()
    resolved = (root / given).resolve()
    if not resolved.is_relative_to(root):
        raise OutsideStateDirError(
            f"{given!r} is outside the server's state directory: a client may only name "
            "files inside it"
        )
    return resolved
