"""Decision log: JSON lines of decisions and their outcomes, rotated by size.

Decisions and their outcomes share one stream, joined later by ``decision_id``
(OPA-style decision ids; Decision-Service-style propensity logging), with a record for
every policy activation (start, swap, set_params, restore, reset) among them::

    {"kind": "decision", "ts": ..., "decision_id": ..., "engine_id": ..., "policy": ...,
     "policy_version": ..., "context": {...}, "gamma": ..., "bin_type": ...,
     "exploration": ..., "exploration_probability": ..., "request_gammas": {...}}
    {"kind": "outcome", "ts": ..., "decision_id": ..., "outcome": {...}}
    {"kind": "policy", "ts": ..., "event": ..., "policy": ..., "policy_version": ...,
     "params": {...}, "state": "fresh" | "kept" | "restored"}

The decision path hands a bounded queue what the decision already holds (the context and
outcome objects, in a record builder); one writer thread builds each record, trims its
per-request sections (:func:`context_fields`, :func:`outcome_fields`), encodes it and writes
it into a ``RotatingFileHandler`` (size-based rotation, backups ``PATH.1`` … ``PATH.N``,
newest first). So the decision path never waits on disk, on JSON encoding or on copying a
large context. Records the queue has no room for, that cannot be encoded or that the disk
refuses (ENOSPC, EIO) are dropped and counted; failures are logged at most once every
:data:`ERROR_INTERVAL_S`, without a traceback. :meth:`DecisionLog.close` writes what is
queued for at most :data:`CLOSE_TIMEOUT_S` and counts the rest as dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import logging.handlers
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from nightjar_common.types import (
    Choice,
    EngineRuntime,
    RequestSignals,
    StepContext,
    StepOutcome,
)

log = logging.getLogger(__name__)

# The trim rule (docs/OPERATIONS.md, "What the decision log keeps, and what it drops"):
# a record keeps a context's or an outcome's first RECORD_REQUESTS per-request sections
# and each kept request's last RECORD_RECENT_ACCEPTS recent accepts; "requests_cut" and
# "recent_accepts_cut" count what went. vLLM's default max_num_seqs below 70 GB of GPU
# memory (256) fits whole. JSON encoding holds the GIL for a whole record, so the deciding
# threads wait for it: the 4,096 x 256 a context may carry would be megabytes to encode.
RECORD_REQUESTS = 256
RECORD_RECENT_ACCEPTS = 16
# At most one ERROR line this often while records fail (a full disk fails every one).
ERROR_INTERVAL_S = 60.0
# Bytes the queued records may hold (their contexts): a few seconds of a slow disk at the
# largest contexts; past it records are dropped and counted.
DEFAULT_MAX_QUEUE_BYTES = 64 << 20
# How long close() writes what is queued: within Kubernetes' default 30 s grace period,
# after the gRPC server's grace and the final snapshot.
CLOSE_TIMEOUT_S = 10.0

Record = Mapping[str, Any] | Callable[[], Mapping[str, Any]]
_STOP = object()


def context_fields(ctx: StepContext) -> dict[str, Any]:
    """A decision record's ``context``, trimmed by the rule above, with its cut counts."""
    fields: dict[str, Any] = {}
    requests = ctx.requests
    if len(requests) > RECORD_REQUESTS:
        fields["requests_cut"] = len(requests) - RECORD_REQUESTS
        requests = requests[:RECORD_REQUESTS]
    sections = [_shallow(r) for r in requests]
    cut = 0
    for section in sections:
        accepts = section["recent_accepts"]
        if len(accepts) > RECORD_RECENT_ACCEPTS:
            cut += len(accepts) - RECORD_RECENT_ACCEPTS
            section["recent_accepts"] = accepts[-RECORD_RECENT_ACCEPTS:]
    if cut:
        fields["recent_accepts_cut"] = cut
    context = dataclasses.asdict(dataclasses.replace(ctx, requests=()))
    context["requests"] = sections
    return {"context": context, **fields}


def outcome_fields(outcome: StepOutcome) -> dict[str, Any]:
    """An outcome record's ``outcome``, trimmed by the rule above, with its cut count."""
    fields = _shallow(outcome)
    cut = len(outcome.request_accepts) - RECORD_REQUESTS
    if cut <= 0:
        return {"outcome": fields}
    fields["request_accepts"] = outcome.request_accepts[:RECORD_REQUESTS]
    fields["request_ids"] = outcome.request_ids[:RECORD_REQUESTS]
    return {"outcome": fields, "requests_cut": cut}


def decision_record(
    ts: float,
    decision_id: str,
    choice: Choice,
    policy: str,
    policy_version: str,
    ctx: StepContext,
) -> dict[str, Any]:
    """The record of a decision an engine ran; ``request_gammas`` (request id → γ, trimmed
    by the rule above) where the policy decided per request."""
    record: dict[str, Any] = {
        "kind": "decision",
        "ts": ts,
        "decision_id": decision_id,
        "engine_id": ctx.engine_id,
        "policy": policy,
        "policy_version": policy_version,
        **context_fields(ctx),
        "gamma": choice.gamma,
        "bin_type": choice.bin_type.value,
        "exploration": choice.exploration,
        "exploration_probability": choice.exploration_probability,
    }
    if choice.request_gammas:
        record["request_gammas"] = dict(choice.request_gammas[:RECORD_REQUESTS])
        cut = len(choice.request_gammas) - RECORD_REQUESTS
        if cut > 0:
            record["request_gammas_cut"] = cut
    return record


def outcome_record(ts: float, outcome: StepOutcome) -> dict[str, Any]:
    """The record of a step's outcome (joined to its decision by ``decision_id``)."""
    return {
        "kind": "outcome",
        "ts": ts,
        "decision_id": outcome.decision_id,
        **outcome_fields(outcome),
    }


def policy_record(
    policy: str, policy_version: str, params: Mapping[str, Any], event: str, state: str
) -> dict[str, Any]:
    """The record of a policy activation: ``event`` (start, swap, set_params, reset,
    restore) and ``state`` (fresh, kept, restored)."""
    return {
        "kind": "policy",
        "ts": time.time(),
        "event": event,
        "policy": policy,
        "policy_version": policy_version,
        "params": dict(params),
        "state": state,
    }


def context_from_json(data: Mapping[str, Any]) -> StepContext:
    """A decision record's ``context`` as the StepContext it was."""
    fields = _known(StepContext, data)
    fields["requests"] = tuple(
        RequestSignals(
            **{**_known(RequestSignals, r), "recent_accepts": tuple(r.get("recent_accepts", ()))}
        )
        for r in fields.get("requests", ())
    )
    runtime = fields.get("runtime")
    if runtime is not None:  # a policy reads it (e.g. whether per-request γ applies)
        fields["runtime"] = EngineRuntime(**_known(EngineRuntime, runtime))
    return StepContext(**fields)


def outcome_from_json(data: Mapping[str, Any]) -> StepOutcome:
    """An outcome record's ``outcome`` as the StepOutcome it was."""
    fields = _known(StepOutcome, data)
    fields["request_accepts"] = tuple(int(x) for x in fields.get("request_accepts", ()))
    return StepOutcome(**fields)


def _known(kind: type[Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """The members of a record's ``data`` that ``kind`` has: a log outlives the version
    that wrote it, and a field since dropped must not make the whole log unreadable."""
    names = {field.name for field in dataclasses.fields(kind)}
    return {key: value for key, value in data.items() if key in names}


def _shallow(flat: Any) -> dict[str, Any]:
    """The fields of a dataclass of plain values and tuples of them, sharing the values
    (JSON encodes a tuple as a list): dataclasses.asdict copies every element of every
    tuple, in Python, competing with the deciding threads for the GIL."""
    return {field.name: getattr(flat, field.name) for field in dataclasses.fields(flat)}


class _Lines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return str(record.msg)  # encoded by the writer before it is handed over


class _Handler(logging.handlers.RotatingFileHandler):
    """Keeps what a write raised (``failure``) for the writer instead of printing it."""

    failure: BaseException | None = None

    def handleError(self, record: logging.LogRecord) -> None:
        self.failure = sys.exc_info()[1]

    def discard_stream(self) -> None:
        """Drop the file a write failed on with what its buffer holds (a record counted
        as dropped); the next record reopens it."""
        stream, self.stream = self.stream, None
        if stream is not None:
            # Its buffer's flush fails again; the file is closed all the same.
            with contextlib.suppress(OSError):
                stream.close()


class DecisionLog:
    def __init__(
        self,
        path: str | Path,
        max_bytes: int = 64 << 20,
        backup_count: int = 5,
        queue_size: int = 65536,
        on_drop: Callable[[], None] | None = None,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
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
        self._handler.setFormatter(_Lines())
        # Counted by the writer thread, except ``_overflowed`` (by the deciding threads).
        self.written = 0
        self._failed = 0
        self._overflowed = 0
        self._overflow_lock = threading.Lock()
        # Estimated bytes the queued records hold (their contexts, write's ``size``): a
        # count alone let a slow disk keep 65,536 contexts of MBs each alive.
        self.queued_bytes = 0
        self._max_queue_bytes = max_queue_bytes
        self._closed = False
        # Failures since the last ERROR line, and when the next may be logged.
        self._unreported = 0
        self._next_error = 0.0
        self._torn = False
        self._writer = threading.Thread(target=self._run, name="decision-log", daemon=True)
        self._writer.start()

    @property
    def dropped(self) -> int:
        return self._failed + self._overflowed

    def write(self, record: Record, size: int = 0) -> None:
        """Queue one record, or a builder the writer calls for it; never blocks. A builder
        runs on the writer thread, so it must read only what nothing changes later.
        ``size``: the estimated bytes it holds until written; past max_queue_bytes queued
        it is dropped and counted, as when the queue is full."""
        try:
            with self._overflow_lock:
                if self._closed or self.queued_bytes + size > self._max_queue_bytes:
                    raise queue.Full
                self.queued_bytes += size
            try:
                self._queue.put_nowait((record, size))
            except queue.Full:
                self._dequeued(size)
                raise
        except queue.Full:
            with self._overflow_lock:
                self._overflowed += 1
            if self._on_drop:
                self._on_drop()

    def _dequeued(self, size: int) -> None:
        with self._overflow_lock:
            self.queued_bytes -= size

    def flush(self) -> None:
        """Wait until every queued record is written or dropped."""
        self._queue.join()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued (for at most ``timeout`` seconds) and stop the writer; what
        it could not write is counted as dropped, and one line says how many of each."""
        self._closed = True
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(_STOP, timeout=timeout)
            stop_queued = 1
        except queue.Full:
            stop_queued = 0
        self._writer.join(max(0.0, deadline - time.monotonic()))
        if self._writer.is_alive():
            # Stuck on a write (a hung disk): the record it is on and those queued are lost
            # with the process; the daemon thread does not hold it up.
            for _ in range(self._queue.unfinished_tasks - stop_queued):
                self._drop()
        else:
            self._handler.discard_stream()
            self._handler.close()
        level = logging.WARNING if self.dropped else logging.INFO
        log.log(
            level,
            "decision log %s closed: %d records written, %d dropped",
            self.path,
            self.written,
            self.dropped,
        )

    def _drop(self) -> None:
        self._failed += 1
        if self._on_drop:
            self._on_drop()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                record, size = item
                self._write(record)
                self._dequeued(size)
            finally:
                self._queue.task_done()

    def _write(self, item: Record) -> None:
        try:
            record = item() if callable(item) else item
            line = json.dumps(record, separators=(",", ":"), allow_nan=False)
        except Exception as exc:  # a record that cannot be encoded (NaN), or a defect
            self._failure(f"cannot encode a record: {exc!r}")
            return
        if self._torn:
            # The failed write may have left part of a line: end it, so this record is a
            # line of its own (readers skip the blank or torn one).
            line = "\n" + line
        handler = self._handler
        handler.failure = None
        handler.emit(logging.makeLogRecord({"msg": line}))
        if handler.failure is not None:
            handler.discard_stream()
            self._torn = True
            self._failure(f"cannot write: {handler.failure}")
            return
        if self._torn:
            self._torn = False
            log.info(
                "decision log %s: writing again (%d records dropped in all)",
                self.path,
                self.dropped,
            )
        self.written += 1

    def _failure(self, what: str) -> None:
        """A dropped record; an ERROR line unless one was logged within ERROR_INTERVAL_S."""
        self._drop()
        self._unreported += 1
        now = time.monotonic()
        if now < self._next_error:
            return
        log.error(
            "decision log %s: %s; %d records dropped since the last such line, counted in "
            "nightjar_decision_log_dropped_total (this line at most every %.0f s)",
            self.path,
            what,
            self._unreported,
            ERROR_INTERVAL_S,
        )
        self._unreported = 0
        self._next_error = now + ERROR_INTERVAL_S


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
