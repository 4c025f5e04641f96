"""Decision log: JSON lines of decisions and their outcomes, rotated by size.

Decisions and their outcomes share one stream, joined later by ``decision_id``
(OPA-style decision ids; Decision-Service-style propensity logging), with a record for
every policy activation (start, swap, set_params, restore, reset) among them::

    {"kind": "decision", "ts": ..., "decision_id": ..., "engine_id": ..., "policy": ...,
     "policy_version": ..., "context": {...}, "gamma": ..., "bin_type": ...,
     "exploration": ..., "exploration_probability": ...}
    {"kind": "outcome", "ts": ..., "decision_id": ..., "outcome": {...}}
    {"kind": "policy", "ts": ..., "event": ..., "policy": ..., "policy_version": ...,
     "params": {...}, "state": "fresh" | "kept" | "restored"}

Records are handed to a bounded queue and written by the standard library's
``QueueListener`` into a ``RotatingFileHandler`` (size-based rotation, backups
``PATH.1`` … ``PATH.N``, newest first), so the decision path never waits on disk or
on JSON encoding. When the writer falls behind, records are dropped and counted. No
``QueueHandler`` on the decision path: it would build and format a ``LogRecord`` there
(~4 µs a record); the listener wraps each record in one on its own thread instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import logging.handlers
import queue
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class _JsonLines(logging.Formatter):
    """One record's dict as one compact JSON line (cached: the handler formats twice,
    once to decide on rotation and once to write)."""

    def format(self, record: logging.LogRecord) -> str:
        line = getattr(record, "json_line", None)
        if line is None:
            line = json.dumps(record.msg, separators=(",", ":"), allow_nan=False)
            record.json_line = line
        return str(line)


class _Listener(logging.handlers.QueueListener):
    """Wraps each queued dict in a LogRecord on the listener's thread."""

    def __init__(self, records: queue.Queue[Any], handler: logging.Handler) -> None:
        super().__init__(records, handler)
        self._records = records

    def prepare(self, record: Any) -> logging.LogRecord:
        return logging.makeLogRecord({"msg": record, "levelno": logging.INFO})

    def enqueue_sentinel(self) -> None:
        # Blocking, unlike the base class's put_nowait: the queue may be full at close.
        self._records.put(getattr(self, "_sentinel", None))


class _Handler(logging.handlers.RotatingFileHandler):
    def handleError(self, record: logging.LogRecord) -> None:
        # A record that cannot be encoded (or a full disk) must not kill the writer.
        log.exception("decision log: cannot write record")


class DecisionLog:
    def __init__(
        self,
        path: str | Path,
        max_bytes: int = 64 << 20,
        backup_count: int = 5,
        queue_size: int = 65536,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        if max_bytes <= 0 or backup_count < 1:
            raise ValueError("a decision log needs max_bytes > 0 and backup_count >= 1")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._on_drop = on_drop
        self._handler = _Handler(
            self.path, maxBytes=max_bytes, backupCount=backup_count, encoding="utf-8"
        )
        self._handler.setFormatter(_JsonLines())
        self._listener = _Listener(self._queue, self._handler)
        self._listener.start()

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
        self._listener.stop()  # writes what is queued, then ends the thread
        self._handler.close()


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


def _files_of(paths: Iterable[str | Path]) -> list[Path]:
    """Each log with its rotated backups, oldest first."""
    files: list[Path] = []
    for path in paths:
        files.extend(log_files(path) or [Path(path)])
    return files


def read_logs(paths: Iterable[str | Path]) -> Iterator[JoinedDecision]:
    """Decisions of the given logs (each with its rotated backups, oldest first) paired with
    their outcomes, in decision order."""
    return join(read_records(_files_of(paths)))


def last_activation(
    paths: Iterable[str | Path], policy: str | None = None
) -> dict[str, Any] | None:
    """The logs' last policy record (the policy and parameters active when they end), or
    the last of ``policy``; None when there is none."""
    found = None
    for record in read_records(_files_of(paths)):
        if (
            record.get("kind") == "policy"
            and isinstance(record.get("params"), dict)
            and policy in (None, record.get("policy"))
        ):
            found = record
    return found
