"""Decision log: JSON lines of decisions and their outcomes, rotated by size.

Two record kinds share one stream, joined later by ``decision_id``
(OPA-style decision ids; Decision-Service-style propensity logging)::

    {"kind": "decision", "ts": ..., "decision_id": ..., "engine_id": ..., "policy": ...,
     "policy_version": ..., "context": {...}, "gamma": ..., "bin_type": ...,
     "exploration": ..., "exploration_probability": ...}
    {"kind": "outcome", "ts": ..., "decision_id": ..., "outcome": {...}}

Writing happens on a background thread so the decision path never waits on
disk; when the writer falls behind, records are dropped and counted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()


class DecisionLog:
    def __init__(
        self,
        path: str | Path,
        max_bytes: int = 64 << 20,
        backup_count: int = 5,
        queue_size: int = 65536,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.backup_count = backup_count
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._on_drop = on_drop
        self._file = self.path.open("a", encoding="utf-8")
        self._thread = threading.Thread(target=self._run, name="decision-log", daemon=True)
        self._thread.start()

    def write(self, record: dict[str, Any]) -> None:
        """Queue one record; never blocks."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            if self._on_drop:
                self._on_drop()

    def flush(self) -> None:
        """Wait until every queued record is on disk."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=5)
        self._file.close()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                line = json.dumps(item, separators=(",", ":"), allow_nan=False) + "\n"
                if self._file.tell() + len(line) > self.max_bytes and self._file.tell() > 0:
                    self._rotate()
                self._file.write(line)
                if self._queue.empty():
                    self._file.flush()
            except Exception:  # a bad record must not kill the writer
                log.exception("decision log: cannot write record")
            finally:
                self._queue.task_done()

    def _rotate(self) -> None:
        self._file.close()
        for index in range(self.backup_count - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
        if self.backup_count > 0:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._file = self.path.open("a", encoding="utf-8")


def log_files(path: str | Path) -> list[Path]:
    """The current file and its rotated backups, oldest first."""
    path = Path(path)
    backups = sorted(
        (p for p in path.parent.glob(f"{path.name}.*") if p.suffix[1:].isdigit()),
        key=lambda p: -int(p.suffix[1:]),
    )
    return [*backups, *([path] if path.exists() else [])]


def read_records(paths: Iterable[str | Path]) -> Iterator[dict[str, Any]]:
    """Records of the given files in order; a torn last line is skipped."""
    for path in paths:
        with Path(path).open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    log.warning("decision log %s:%d: unreadable line skipped", path, number)


@dataclasses.dataclass(slots=True)
class JoinedDecision:
    decision: dict[str, Any]
    outcome: dict[str, Any] | None


def join(records: Iterable[dict[str, Any]]) -> Iterator[JoinedDecision]:
    """Pair decisions with their outcomes, in decision order."""
    decisions: dict[str, JoinedDecision] = {}
    order: list[str] = []
    for record in records:
        decision_id = record.get("decision_id", "")
        if record.get("kind") == "decision":
            decisions[decision_id] = JoinedDecision(record, None)
            order.append(decision_id)
        elif record.get("kind") == "outcome" and decision_id in decisions:
            decisions[decision_id].outcome = record.get("outcome")
    for decision_id in order:
        yield decisions[decision_id]
