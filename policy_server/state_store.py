"""The learned state: reads (GetState), snapshots and restores.

A read holds no more than one engine's learner at a time (_read_state says why that is
enough for a snapshot); a snapshot is written only in the form a start reads (the
reader's own checks and size limit); a restore activates a snapshot's policy, params
and state atomically, refusing a state the next snapshot could not hold.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from nightjar_common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NightjarError,
    NotFoundError,
    PermissionDeniedError,
)
from nightjar_common.validation import check_client_path
from policy_server import forked, json_pieces, snapshot
from policy_server.activation import ActivePolicy, PolicyActivation, load_state
from policy_server.engines import EngineTable
from policy_server.memory import MemoryController
from policy_server.metrics import DECISIONS, REPORTS, Metrics
from policy_server.policies import Policy, learned_state
from policy_server.policies.base import UNOWNED, trim_state, with_room_to_count
from policy_server.state_text import StateText, round_trip

log = logging.getLogger(__name__)

# How long a read of learned state (state_view, snapshots; see _read_state) reads engines'
# parts before it encodes them and hands the GIL over (goodput's part of an engine takes
# about 0.2 ms to build, so a few engines a chunk). A decision that waits for one of
# these locks holds up the event loop, and every engine with it: a fraction of the 2 ms
# deadline.
STATE_HOLD_S = 0.0005
# Reads of the whole state a policy activation may restart before one holds every lock.
STATE_READ_ATTEMPTS = 3


class Hold(enum.Enum):
    """What a read of the state holds (_read_chunks)."""

    # Each engine's learner in turn, the GIL handed over between chunks.
    ENGINES = "engines"
    # Every lock of the policy throughout (the last of STATE_READ_ATTEMPTS).
    WHOLE = "whole"
    # Nothing: a forked child reads the copy it was given, which nothing else changes.
    FROZEN = "frozen"


class CollectorPause:
    """CPython's cyclic garbage collector off while whole-state work runs (reads,
    snapshots, restores; and a heavy request's parse and step, grpc_server.py): it
    allocates hundreds of thousands of objects, each batch of
    which starts a collection, and a full one scans the whole heap holding the GIL (some
    70 ms over the ~250,000 objects of 56 engines' per-request records on a slow host):
    the loop that answers every engine would wait for it. What the work leaves is freed
    by reference counting as usual; cycles wait for the collector's next run. Holders
    overlap (concurrent admin calls): the collector comes back on with the last, and only
    if it was on before the first.

    ``keep``: what the work made is long-lived (a restored state): frozen (gc.freeze) once
    it is done, so that no collection scans it again. Paused alone only defers them: after
    a restore the next young, middle and full collections each scan its hundreds of
    thousands of new objects, holding the GIL for tens of ms. A frozen object is still
    freed by reference counting when let go of (the state of a policy replaced later:
    trees of dicts and lists); only a cycle among frozen objects would outlive its last
    reference."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._restart = False

    @contextlib.contextmanager
    def paused(self, keep: bool = False) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._restart = gc.isenabled()
                gc.disable()
            self._holders += 1
        try:
            yield
            if keep:
                gc.freeze()
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._restart:
                    gc.enable()


# One for the process: the collector is the process's.
COLLECTOR = CollectorPause()


@dataclasses.dataclass(frozen=True, slots=True)
class StateView:
    policy_name: str
    policy_version: str
    params: dict[str, Any]
    # The learned state as JSON text in UTF-8 (read and encoded an engine at a time,
    # _read_state; the whole state in a forked child, _read_in_child): bytes, as GetState
    # sends it, so that tens of MB are never decoded and encoded again holding the GIL.
    state_utf8: bytes
    decisions_total: int
    reports_total: int
    engine_ids: list[str]
    last_snapshot_unix: float
    memory: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Engines the sidecar holds; engine_ids may show fewer (a summary, state_view).
    engines_total: int = 0
    # How each engine shown runs speculation (EngineShard.runtime_view).
    engines: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The fleet link's status (fleet_link.FleetLink.status); {} without one.
    fleet: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def state_json(self) -> str:
        return self.state_utf8.decode()

    @property
    def state(self) -> dict[str, Any]:
        """The learned state (state_json, parsed)."""
        state: dict[str, Any] = json.loads(self.state_utf8)
        return state


@dataclasses.dataclass(frozen=True, slots=True)
class StateRead:
    """What _read_state read: the policy, its state's JSON, engines' memory states."""

    active: ActivePolicy
    state_utf8: bytes
    memory: dict[str, Any]
    # The engines read, in order (those asked for, or with _read_in_child all of them).
    engine_ids: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    """What a whole read in a child reads in the parent, under every lock at the fork."""

    active: ActivePolicy
    engine_ids: list[str]
    unix: float  # the instant (a snapshot's created_unix)
    # For a snapshot: the policy that checks it (StateStore._checker), built for the
    # active version before the fork; None if it is not that version.
    checker: Policy | None = None


# What makes a snapshot fail as refused (FAILED_PRECONDITION, counted), not as a defect.
SNAPSHOT_REFUSALS: tuple[type[BaseException], ...] = (OSError, ValueError, TypeError, NightjarError)


class StateStore:
    """Reads, snapshots and restores the active policy's learned state."""

    def __init__(
        self,
        activation: PolicyActivation,
        engines: EngineTable,
        *,
        metrics: Metrics,
        memory: MemoryController,
        state_dir: Path | None,
        snapshot_max_bytes: int,
    ) -> None:
        self.activation = activation
        self.engines = engines
        self.metrics = metrics
        self.memory = memory
        self.state_dir = state_dir
        # The most a snapshot may take; never past what a start reads (snapshot.MAX_BYTES).
        self.snapshot_max_bytes = snapshot_max_bytes
        self.last_snapshot_unix = 0.0
        # Whole-state reads (GetState with the token, snapshots) one at a time: each costs
        # CPU in proportion to the engines, taken from the decisions (the GIL).
        self._whole_reads = threading.Lock()
        # A policy as a start builds it, with its empty state, to check snapshots with
        # (_readable): built once per policy version (building one reads its files).
        self._snapshot_checker: tuple[str, Policy, dict[str, Any]] | None = None
        self._snapshot_checks = threading.Lock()
        # Whole-state work (whole reads, snapshots, client restores) in forked children,
        # off the GIL the decisions need (forked.py); None: in process, on the admin
        # thread (no fork on this platform).
        self.children: forked.Children | None = forked.Children() if forked.can_fork() else None

    # -- reads --------------------------------------------------------------------------

    def state_view(
        self, engine_id: str | None = None, *, max_engines: int | None = None
    ) -> StateView:
        """The active policy and its learned state: one engine's part, or the whole, read
        an engine at a time while decisions go on (_read_state), or with ``max_engines`` a
        summary: the parts of the first ``max_engines`` engines by id and as many ids, with
        the count of all in ``engines_total`` (what GetState answers a caller without the
        admin token). Whole reads take turns (``_whole_reads``); in a forked child when
        there are children (_read_in_child: one instant of the whole state)."""
        all_ids = sorted(self.engines.engine_ids())
        shown = all_ids if max_engines is None else all_ids[:max_engines]
        if engine_id:
            if engine_id not in self.engines:
                raise NotFoundError(f"unknown engine {engine_id!r}")
            read = self._read_state([engine_id], whole=False, allow_nan=True)
        elif max_engines is not None:
            read = self._read_state(shown, whole=False, allow_nan=True)
        elif self.children is not None and (
            child_read := self._read_in_child(allow_nan=True, memory=True)
        ):
            read = child_read
            all_ids = shown = read.engine_ids
        else:
            with self._whole_reads, COLLECTOR.paused():
                read = self._read_state(shown, whole=True, allow_nan=True)
        active = read.active
        return StateView(
            policy_name=active.name,
            policy_version=active.version,
            params=active.policy.params(),
            state_utf8=read.state_utf8,
            decisions_total=int(self.metrics.steps.total(DECISIONS)),
            reports_total=int(self.metrics.steps.total(REPORTS)),
            engine_ids=shown,
            last_snapshot_unix=self.last_snapshot_unix,
            memory={"params": dataclasses.asdict(self.memory.params), "engines": read.memory},
            engines_total=len(all_ids),
            engines=self._runtimes(shown if not engine_id else [engine_id]),
        )

    def _runtimes(self, engine_ids: Sequence[str]) -> dict[str, Any]:
        views = {}
        for engine_id in engine_ids:
            shard = self.engines.get(engine_id)
            view = shard.runtime_view() if shard is not None else None
            if view is not None:
                views[engine_id] = view
        return views

    def _read_state(
        self, engine_ids: Sequence[str], whole: bool, allow_nan: bool, memory: bool = True
    ) -> StateRead:
        """The active policy, the learned state of ``engine_ids`` as JSON text (``whole``:
        with the part no engine's shows, LearnedState.state) and, with ``memory``, their
        memory-controller states. ``allow_nan`` False: ValueError for a NaN or infinity.

        Each engine's part is read holding its learner's lock only (the part no engine
        owns, every learner's), in chunks of STATE_HOLD_S with the GIL handed over between
        them, so a decision waits for one part of its own learner at most, never for the
        whole state (with 10,000 engines of goodput that takes seconds); each chunk is
        encoded as JSON outside the locks (state_text.py). So the result is not one point in
        time: each engine's part (its record and the learner it updates) is read at once
        and is consistent on its own, a learner engines share is the one read last, and an
        engine that comes or goes during the read may be missing. That is all a snapshot
        needs: an engine's decisions read its own part only, so a restored engine goes on
        from a state it was in, as if the snapshot had been taken a moment earlier or later
        for it. A policy activated during the read makes it start again; the last of
        STATE_READ_ATTEMPTS holds every lock throughout (activations are admin calls)."""
        ids = [*engine_ids, UNOWNED] if whole else list(engine_ids)
        for attempt in range(1, STATE_READ_ATTEMPTS + 1):
            hold = Hold.WHOLE if attempt == STATE_READ_ATTEMPTS else Hold.ENGINES
            read = self._read_chunks(ids, allow_nan, memory, hold)
            if read is not None:
                return dataclasses.replace(read, engine_ids=list(engine_ids))
        raise AssertionError("unreachable: the last attempt holds the lock throughout")

    def _read_chunks(
        self, ids: Sequence[str], allow_nan: bool, memory: bool, hold: Hold
    ) -> StateRead | None:
        """One attempt of _read_state; None when a policy was activated meanwhile."""
        activation = self.activation
        text = StateText(allow_nan)
        memories: dict[str, Any] = {}
        engines = hold is Hold.ENGINES
        held = activation.whole_policy() if hold is Hold.WHOLE else contextlib.nullcontext()
        with held:
            active = activation.active
            done = 0
            while done < len(ids):
                parts: list[dict[str, Any]] = []
                until = time.perf_counter() + STATE_HOLD_S
                while done < len(ids) and (not engines or not parts or _before(until)):
                    engine_id = ids[done]
                    done += 1
                    with contextlib.ExitStack() as holding:
                        if engines:  # the engine's learner only, or all for UNOWNED
                            holding.enter_context(self._engine_part(engine_id))
                        if activation.active is not active:
                            return None
                        # state() builds new JSON data: nothing of it changes once unlocked.
                        parts.append(active.learned.state(engine_id))
                        engine_memory = self.memory.engines.get(engine_id) if memory else None
                        if engine_memory is not None:
                            memories[engine_id] = engine_memory.as_dict()
                for part in parts:
                    text.add(part)
                if engines:
                    # Hand the GIL over: a decision woken by the release takes the lock
                    # before this thread takes it again (CPython's locks are not fair).
                    time.sleep(0)
        state_json = text.text() if text else json.dumps({"schema": active.learned.state_schema})
        return StateRead(active, state_json.encode(), dict(sorted(memories.items())), list(ids))

    def _frozen(self, checker: bool = False) -> contextlib.AbstractContextManager[Frozen]:
        """Every lock of the policy, and what a child's whole read needs read under them:
        the active policy and every engine's id (the engine table's lock, which the child
        must not take); with ``checker`` the snapshots' checker too (its lock held, so
        that no thread uses it at the fork). Held only while the process forks."""

        @contextlib.contextmanager
        def frozen() -> Iterator[Frozen]:
            with contextlib.ExitStack() as held:
                prepared = None
                if checker:
                    held.enter_context(self._snapshot_checks)
                    active = self.activation.active
                    spec = {"name": active.name, "version": active.version}
                    prepared = self._checker({**spec, "params": active.policy.params()})[0]
                held.enter_context(self.activation.whole_policy())
                active, ids = self.activation.active, sorted(self.engines.engine_ids())
                if prepared is not None and active.version != spec["version"]:
                    prepared = None  # activated since: the child builds its own
                yield Frozen(active, ids, time.time(), prepared)

        return frozen()

    def _read_frozen(self, frozen: Frozen, allow_nan: bool, memory: bool) -> StateRead:
        """In a forked child: the whole state as the fork froze it (every engine's part
        and the unowned learners), read with no lock (nothing else runs in the child)."""
        read = self._read_chunks([*frozen.engine_ids, UNOWNED], allow_nan, memory, Hold.FROZEN)
        assert read is not None  # nothing activates a policy in the child
        return read

    def _read_in_child(self, allow_nan: bool, memory: bool) -> StateRead | None:
        """The whole state read in a forked child: its learned state, and every engine's,
        at one instant (the fork, holding every lock of the policy), encoded by the child
        while the parent's threads go on deciding. None when the child could not hand it
        over (_handed_over): the caller reads it in process."""
        assert self.children is not None

        def work(frozen: Frozen, sink: forked.Sink) -> dict[str, Any]:
            read = self._read_frozen(frozen, allow_nan, memory)
            sink(read.state_utf8)
            return read.memory

        try:
            frozen, result = self.children.run(self._frozen(), work)
        except forked.ChildError as exc:
            _handed_over(exc, "a whole-state read")
            return None
        return StateRead(frozen.active, result.payload, result.value, frozen.engine_ids)

    def _engine_part(self, engine_id: str) -> contextlib.AbstractContextManager[None]:
        """What reading ``engine_id``'s part of the state holds (UNOWNED: every learner)."""
        if engine_id == UNOWNED:
            return self.activation.learner_locks.every()
        return self.activation.learner_part(engine_id, "")

    # -- snapshots ----------------------------------------------------------------------

    def snapshot_document(self) -> dict[str, Any]:
        """The snapshot of the active policy (snapshot_text, parsed)."""
        text, _ = self.snapshot_text()
        document: dict[str, Any] = json.loads(text)
        return document

    def snapshot_text(self) -> tuple[str, float]:
        """The snapshot document of the active policy as JSON text (what snapshot.parse
        reads), and its created_unix: its params and whole learned state, read in process
        an engine at a time while decisions go on (_read_state says why each engine's part
        is consistent, the whole not one point in time, and why that is enough).
        ValueError for a NaN or infinity in the state."""
        engines = sorted(self.engines.engine_ids())
        created = time.time()
        with self._whole_reads:
            read = self._read_state(engines, whole=True, allow_nan=False, memory=False)
        return _document_text(read.active, read.state_utf8.decode(), engines, created), created

    def write_snapshot(self) -> Path:
        """Write the snapshot file: the state read and checked in a forked child when
        there are children (one instant of the whole state, _snapshot_in_child), else in
        process with the collector paused. FailedPreconditionError, the last snapshot
        kept, when it cannot be written."""
        if self.state_dir is None:
            raise FailedPreconditionError("no state directory configured (--state-dir)")
        path = self.state_dir / snapshot.SNAPSHOT_NAME
        try:
            if self.children is not None:
                data, created, trimmed = self._snapshot_in_child()
            else:
                with COLLECTOR.paused():
                    text, created = self.snapshot_text()
                    data, trimmed = self._readable(text.encode())
            if trimmed:
                log.warning("%s", trimmed)
            snapshot.write_bytes_atomic(path, data)
        except (forked.ChildError, OSError, ValueError, TypeError, NightjarError) as exc:
            # ValueError: a NaN or infinity in the state (refused when it comes in; this
            # keeps one that slipped through from ending the snapshot loop).
            if isinstance(exc, forked.ChildError) and not exc.is_a(*SNAPSHOT_REFUSALS):
                raise  # a defect, as in process
            self.metrics.snapshots.labels("failed").inc()
            raise FailedPreconditionError(
                f"cannot write snapshot {path}: {exc}; the last snapshot is kept"
            ) from exc
        self.last_snapshot_unix = created
        self.metrics.snapshot_written(self.last_snapshot_unix)
        return path

    def _snapshot_in_child(self) -> tuple[bytes, float, str]:
        """The snapshot file's bytes, read, encoded and checked (_checked) by a forked
        child from one instant of the state; its created_unix; what was trimmed."""
        assert self.children is not None

        def work(frozen: Frozen, sink: forked.Sink) -> str:
            read = self._read_frozen(frozen, allow_nan=False, memory=False)
            text = _document_text(
                frozen.active, read.state_utf8.decode(), frozen.engine_ids, frozen.unix
            )
            data = text.encode()
            document = snapshot.parse(data, "the snapshot to write")
            spec = document["policy"]
            # The parent's checker as copied (what it loads stays in the child), or one of
            # its own (built again: logged again).
            checker = frozen.checker or self.activation.build(spec["name"], spec["params"])
            data, trimmed = self._checked(data, document, checker)
            sink(data)
            return trimmed

        frozen, result = self.children.run(self._frozen(checker=True), work)
        return result.payload, frozen.unix, str(result.value)

    def _readable(self, data: bytes) -> tuple[bytes, str]:
        """``data`` (a snapshot document) as a start will read it (_checked), with the
        policy a start would build (kept between snapshots), and what was trimmed."""
        document = snapshot.parse(data, "the snapshot to write")
        spec = document["policy"]
        with self._snapshot_checks:
            checker, empty = self._checker(spec)
            try:
                return self._checked(data, document, checker)
            finally:
                learned_state(checker).load_state(empty)  # no copy kept between snapshots

    def _checked(self, data: bytes, document: dict[str, Any], checker: Policy) -> tuple[bytes, str]:
        """``data`` (``document`` encoded) checked by the reader's own checks (snapshot.
        parse made ``document``, then ``checker``'s load_state as a start loads it) and
        within the reader's size limit, trimmed of what the policy can lose (base.
        trim_state) when it is larger; and a WARNING's text naming what was trimmed ("":
        nothing). SnapshotError when nothing makes it fit, InvalidArgumentError or
        FailedPreconditionError when a start would refuse it."""
        limit = min(self.snapshot_max_bytes, snapshot.MAX_BYTES)
        data, trimmed = self._within(limit, data, document, checker)
        load_state(checker, document["policy"]["state"])
        return data, trimmed

    def _checker(self, spec: Mapping[str, Any]) -> tuple[Policy, dict[str, Any]]:
        """The policy a start would build for a snapshot's ``spec``, and its empty state."""
        version = str(spec.get("version", ""))
        if self._snapshot_checker is None or self._snapshot_checker[0] != version:
            checker = self.activation.build(spec["name"], spec["params"])
            self._snapshot_checker = (version, checker, learned_state(checker).state())
        _, checker, empty = self._snapshot_checker
        return checker, empty

    def _within(
        self, limit: int, data: bytes, document: dict[str, Any], policy: Policy
    ) -> tuple[bytes, str]:
        """``data`` (``document`` encoded) if it is at most ``limit`` bytes, else
        ``document`` trimmed of what ``policy`` can lose and encoded again (SnapshotError
        when that is still larger); with the text of a WARNING for the trim ("": none)."""
        spec = document["policy"]
        if len(data) <= limit:
            return data, ""
        size = len(data)
        dropped = trim_state(policy, spec["state"], size - limit)
        data = snapshot.encode(document)
        if len(data) > limit:
            trimmed = f" after dropping {dropped}" if dropped else ""
            raise snapshot.SnapshotError(
                f"the snapshot is {len(data):,} bytes{trimmed}, more than the "
                f"{limit:,} bytes a start reads"
            )
        return data, (
            f"snapshot trimmed from {size:,} to {len(data):,} bytes to fit the {limit:,} a "
            f"start reads; dropped: {dropped}"
        )

    # -- restores -------------------------------------------------------------------------

    def restore_document(
        self, document: Mapping[str, Any], *, from_client: bool = True, keep_state: bool = True
    ) -> ActivePolicy:
        """Activate the policy, params and state of a snapshot; all-or-nothing
        (_restore_document), in process with the collector paused, what it made kept."""
        with COLLECTOR.paused(keep=True):
            return self._restore_document(document, from_client=from_client, keep_state=keep_state)

    def restore_json(self, text: str | bytes) -> ActivePolicy:
        """Restore a client's snapshot document given as JSON text (Restore's
        snapshot_json): parsed and checked in a forked child when there are children
        (restore_client). INVALID_ARGUMENT when it is not a snapshot."""
        return self.restore_client(lambda: document_of_json(text, "snapshot_json"))

    def restore_path(self, given: str) -> ActivePolicy:
        """Restore a snapshot file inside the state directory (relative paths start
        there); read, parsed and checked in a forked child when there are children."""
        return self.restore_client(lambda: self.document_at(given))

    def document_at(self, given: str) -> dict[str, Any]:
        """The snapshot document of a client-named file inside the state directory
        (relative paths start there): PERMISSION_DENIED outside it, NOT_FOUND when there is
        no such file, INVALID_ARGUMENT when it is not a snapshot."""
        check_client_path(given)
        try:
            path = snapshot.confine(self.state_dir, given)
        except snapshot.OutsideStateDirError as exc:
            raise PermissionDeniedError(str(exc)) from exc
        if not path.exists():
            raise NotFoundError(f"snapshot file {path} does not exist")
        try:
            return snapshot.read(path)
        except snapshot.SnapshotError as exc:
            raise InvalidArgumentError(str(exc)) from exc

    def restore_client(self, read: Callable[[], dict[str, Any]]) -> ActivePolicy:
        """Activate the snapshot document ``read`` gives (a client's): in process when
        there are no children, else in a forked child: the document read, parsed and
        checked there (_restorable), the state the policy is to hold handed back in pieces
        (json_pieces), loaded and activated here. Each piece is a short hold of the GIL,
        where one json.loads of the document holds it for hundreds of milliseconds."""
        if self.children is None:
            return self._restore_in_process(read)

        def work(_: None, sink: forked.Sink) -> dict[str, Any]:
            document = read()
            candidate, engines = self._candidate(document, from_client=True, keep_state=True)
            for piece in json_pieces.encode(self._restorable(candidate, document)):
                sink(piece)
            return {"name": candidate.name, "params": candidate.params(), "engines": engines}

        try:
            _, result = self.children.run(forked.nothing_held(), work)
        except forked.ChildError as exc:
            _handed_over(exc, "a restore")
            return self._restore_in_process(read)
        chosen = result.value
        with COLLECTOR.paused(keep=True):
            candidate = self.activation.build(chosen["name"], chosen["params"])
            state = json_pieces.decode(result.payload)
            load_state(candidate, state)
            json_pieces.release(state)  # what the policy did not keep, freed in pieces
        return self._activate_restored(candidate, chosen["engines"], keep_state=True)

    def _restore_in_process(self, read: Callable[[], dict[str, Any]]) -> ActivePolicy:
        with COLLECTOR.paused(keep=True):
            return self._restore_document(read(), from_client=True, keep_state=True)

    def _restore_document(
        self, document: Mapping[str, Any], *, from_client: bool, keep_state: bool
    ) -> ActivePolicy:
        """Activate the policy, params and state of a snapshot; all-or-nothing.

        ``from_client``: file paths in its params are confined to the state directory
        (False only for the server's own snapshot at start), and its state checked
        (_restorable). ``keep_state`` False: the policy and params only, with fresh state
        (a state that does not fit them, at start)."""
        candidate, engines = self._candidate(document, from_client, keep_state)
        if keep_state and from_client:
            state = self._restorable(candidate, document)
            candidate = self.activation.build(candidate.name, candidate.params())
            load_state(candidate, state)
        elif keep_state:
            load_state(candidate, document["policy"]["state"])
        return self._activate_restored(candidate, engines, keep_state)

    def _candidate(
        self, document: Mapping[str, Any], from_client: bool, keep_state: bool
    ) -> tuple[Policy, list[str]]:
        """The policy a snapshot names, built with its params (a client's file paths
        confined to the state directory), not yet holding its state; the engines it
        restores (none without ``keep_state``)."""
        spec = document["policy"]
        params = spec["params"]
        if from_client and isinstance(params, Mapping):
            params = self.activation.confine_paths(spec["name"], params)
        candidate = self.activation.build(spec["name"], params)
        # Read whole before the engine table is cleared: a malformed one must not wipe it.
        engines = [str(e) for e in document.get("engines", [])] if keep_state else []
        return candidate, engines

    def _activate_restored(
        self, candidate: Policy, engines: Sequence[str], keep_state: bool
    ) -> ActivePolicy:
        """``candidate`` active, ``engines`` known (their state restored) and not active;
        the policy it replaces freed an engine at a time once no lock is held (_release)."""
        activation = self.activation
        with activation.whole_policy():
            replaced, known = activation.active, self.engines.engine_ids()
            self.engines.clear()
            for engine_id in engines:
                shard, _ = self.engines.shard(str(engine_id))
                shard.last_seen = -math.inf  # known (its state is restored), not active
            state = "restored" if keep_state else "fresh"
            active = activation.activate(candidate, "restore", state)
        _release(replaced, known)
        return active

    def _restorable(self, candidate: Policy, document: Mapping[str, Any]) -> dict[str, Any]:
        """The state a policy built as ``candidate`` is to hold after restoring a
        client's ``document``, refused (INVALID_ARGUMENT, naming the field) unless the
        snapshots that follow can be written and read at start: its floats within
        snapshot.MAX_RESTORED_FLOAT and its counts half their limit (room to grow), and
        what the policy then holds encodes as JSON and fits a snapshot (trimmed as the
        writer trims). The caller loads it into a policy built afresh, as a start loads
        a snapshot (``candidate`` holds the state as given)."""
        state = document["policy"]["state"]
        try:
            snapshot.check_numbers(state, "policy.state", snapshot.MAX_RESTORED_FLOAT)
        except snapshot.SnapshotError as exc:
            raise InvalidArgumentError(f"snapshot state is out of range: {exc}") from exc
        with with_room_to_count():
            load_state(candidate, state)
        learned = learned_state(candidate)
        try:
            held = learned.state()
            # Encoded and decoded an engine at a time: the loop keeps the GIL's turns.
            loaded, size = round_trip(held)
        except (ArithmeticError, ValueError, TypeError) as exc:
            raise InvalidArgumentError(
                f"snapshot state could not be written back: {_unwritable(candidate, exc)}"
            ) from exc
        limit = min(self.snapshot_max_bytes, snapshot.MAX_BYTES)
        if size > limit:  # ASCII: JSON's encoder escapes the rest
            trim_state(candidate, held, size - limit)
            loaded, trimmed = round_trip(held)
            if trimmed > limit:
                raise InvalidArgumentError(
                    f"snapshot state takes {size:,} bytes, more than the {limit:,} a "
                    "snapshot may take, after dropping what can be dropped"
                )
        return loaded


def document_of_json(text: str | bytes, origin: str) -> dict[str, Any]:
    """A client's snapshot document (snapshot.parse), refused with INVALID_ARGUMENT."""
    try:
        return snapshot.parse(text, origin)
    except snapshot.SnapshotError as exc:
        raise InvalidArgumentError(str(exc)) from exc


def _release(replaced: ActivePolicy, engine_ids: Sequence[str]) -> None:
    """Free a replaced policy's learned state an engine's part at a time (its reset):
    dropped whole (where activate replaces it, under every lock of the policy), tens of MB
    of per-request records are freed in one deallocation holding the GIL for tens of
    milliseconds. Nothing decides with a replaced policy: a step that read it before the
    activation finds it replaced once it holds its learner's lock, and starts again."""
    for engine_id in engine_ids:
        replaced.learned.reset(engine_id)


def _unwritable(policy: Policy, exc: Exception) -> str:
    """Why ``policy``'s state cannot be written: the field that is not finite if there is
    one, else ``exc``."""
    try:
        snapshot.check_numbers(learned_state(policy).state(), "policy.state")
    except snapshot.SnapshotError as named:
        return str(named)
    except (ArithmeticError, ValueError, TypeError):
        pass
    return repr(exc)


def _document_text(
    active: ActivePolicy, state_json: str, engines: Sequence[str], created: float
) -> str:
    """The snapshot document of ``active`` with its state's JSON, as JSON text."""
    head = {"format": snapshot.FORMAT, "created_unix": created}
    policy = {"name": active.name, "version": active.version, "params": active.policy.params()}
    return (
        snapshot.encode_text(head)[:-1]
        + ',"policy":'
        + snapshot.encode_text(policy)[:-1]
        + f',"state":{state_json}}}'
        + f',"engines":{snapshot.encode_text(list(engines))}}}'
    )


def _before(deadline: float) -> bool:
    return time.perf_counter() < deadline


def _handed_over(exc: forked.ChildError, work: str) -> None:
    """Raise the error a child's ``work`` raised (its contract error, same status code),
    unless the child failed to hand its result over — an OSError writing the memory file
    (the process's file-size limit applies to it, or memory ran short): then the caller
    does the work in process, as where there is no fork."""
    if not exc.is_a(OSError):
        raise exc.rebuilt() from None
    log.warning("nightjar: %s done in process: its child could not hand it over: %s", work, exc)
