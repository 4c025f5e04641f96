"""Per-engine bookkeeping of the decision service, one shard per engine, bounded.

Each engine's pending decisions, the decision tables it was sent and its last
activity live in its own shard with its own lock, so engines do not wait on each other
for bookkeeping (the policy's part an engine changes is under its learner's lock,
learner_locks.py: engines of one learner key share it).
Everything a client can make the sidecar hold is bounded: engines, learner keys and
pending decisions per engine; past a bound the least recently used entry is evicted
and counted (``nightjar_evictions_total{kind}``), so a misbehaving client costs memory
up to the bound, never more.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from nightjar_common.types import (
    Choice,
    EngineRuntime,
    MemoryDirective,
    StepContext,
    StepOutcome,
)

# Eviction kinds, as counted in nightjar_evictions_total{kind}.
ENGINE = "engine"
LEARNER_KEY = "learner_key"
PENDING = "pending"
EVICTION_KINDS = (ENGINE, LEARNER_KEY, PENDING)


@dataclasses.dataclass(frozen=True, slots=True)
class Bounds:
    """How much a sidecar holds for its clients (docs/OPERATIONS.md, "Bounded memory")."""

    # Engines with bookkeeping and policy state; a node runs a handful.
    max_engines: int = 1024
    # Distinct learner keys (model@device); a fleet has a few dozen.
    max_learner_keys: int = 256
    # Decisions awaiting their outcome, per engine; an engine has two or three in flight.
    max_pending_per_engine: int = 64
    # Bytes the contexts of an engine's pending decisions may take (context_bytes): a
    # context with every per-request section at its bound takes ~10 MB, so three such.
    max_pending_bytes_per_engine: int = 32 << 20
    # The same for all engines together: a few hosts' worth of large engines.
    max_pending_bytes: int = 512 << 20
    # Bytes an engine's kept decision tables may take (table_bytes): a per-request table
    # of 4,096 requests takes ~0.3 MB; past it the oldest are no longer kept (their steps
    # are still learned from, as "late").
    max_table_bytes_per_engine: int = 1 << 20

    def __post_init__(self) -> None:
        for name in dataclasses.fields(self):
            if getattr(self, name.name) < 1:
                raise ValueError(f"{name.name} must be >= 1")

    def pending_refusal(self, size: int, engine_held: int, total_held: int) -> str:
        """Why a pending decision whose context takes ``size`` bytes cannot be held by an
        engine holding ``engine_held`` of the ``total_held`` bytes of all ("" when it can:
        the engine's own older ones are evicted to make room)."""
        if size > self.max_pending_bytes_per_engine:
            return (
                f"its context takes ~{size:,} bytes, more than the "
                f"{self.max_pending_bytes_per_engine:,} an engine's pending decisions may "
                "take (max_pending_bytes_per_engine in the server's config file)"
            )
        if total_held - engine_held + size > self.max_pending_bytes:
            return (
                f"its context takes ~{size:,} bytes and other engines' pending decisions "
                f"hold ~{total_held - engine_held:,} of the {self.max_pending_bytes:,} "
                "all may take (max_pending_bytes in the server's config file)"
            )
        return ""


# What a held StepContext costs in memory, estimated from counts and lengths (the Python
# objects wire.context_from_pb makes: measured with tracemalloc, within a few %), never
# by walking its objects: a context, each per-request section, each character of its
# request id, each recent_accepts entry.
CONTEXT_BYTES = 1024
REQUEST_BYTES = 176
RECENT_ACCEPT_BYTES = 8
# A kept decision table, each of its entries, each request γ of a per-request choice; a
# table only remembered (KnownTable), with its γ bytes.
TABLE_BYTES = 512
TABLE_ENTRY_BYTES = 120
REQUEST_GAMMA_BYTES = 64
KNOWN_TABLE_BYTES = 320


def context_bytes(ctx: StepContext) -> int:
    """The estimated bytes ``ctx`` holds (its per-request sections are most of it)."""
    if not ctx.requests:
        return CONTEXT_BYTES
    # One plain loop: every ran step's context passes here, and two generator passes
    # over its requests cost nearly twice as much on CPython 3.11.
    ids = accepts = 0
    for request in ctx.requests:
        ids += len(request.request_id)
        accepts += len(request.recent_accepts)
    return CONTEXT_BYTES + REQUEST_BYTES * len(ctx.requests) + ids + RECENT_ACCEPT_BYTES * accepts


def outcome_bytes(outcome: StepOutcome) -> int:
    """The estimated bytes ``outcome`` holds (its per-request ids and accepts)."""
    ids = outcome.request_ids
    return CONTEXT_BYTES + REQUEST_BYTES * len(ids) + sum(map(len, ids)) if ids else CONTEXT_BYTES


def table_bytes(table: IssuedTable) -> int:
    """The estimated bytes a kept ``table`` holds (its choices are shared by sizes)."""
    distinct = {id(choice): choice for choice, _ in table.entries}.values()
    gammas = sum(len(choice.request_gammas) for choice in distinct)
    entries = len(table.entries) + len(table.exploits)
    return TABLE_BYTES + TABLE_ENTRY_BYTES * entries + REQUEST_GAMMA_BYTES * gammas


@dataclasses.dataclass(frozen=True, slots=True)
class PendingDecision:
    ctx: StepContext
    choice: Choice
    revision: int
    gamma_max: int
    # context_bytes(ctx), counted in the byte budgets while it is held.
    size: int = CONTEXT_BYTES


# KnownTable.exploits' byte of an entry that does not explore (γ is at most 64).
NO_EXPLOIT = 255


@dataclasses.dataclass(frozen=True, slots=True)
class IssuedTable:
    """A decision table as the sidecar keeps it until the engine reports its steps: per
    batch size, the choice and the policy's checkpoint after it (committed by the step
    that runs it); per exploring entry, the same of the choice exploited there instead
    (GammaTable.exploit_gammas; () when the table has none)."""

    revision: int
    gamma_max: int
    first_batch_size: int
    entries: tuple[tuple[Choice, object], ...]
    exploits: tuple[tuple[Choice, object] | None, ...] = ()

    def entry(self, batch_size: int, exploited: bool = False) -> tuple[Choice, object] | None:
        """The entry a step of ``batch_size`` ran: its exploit where ``exploited``."""
        index = batch_size - self.first_batch_size
        entries = self.exploits if exploited else self.entries
        return entries[index] if 0 <= index < len(entries) else None


@dataclasses.dataclass(slots=True)
class KnownTable:
    """What the sidecar remembers of a table it issued, kept or not: enough to check a
    step run from it (the γ each entry allowed) and to learn each of its steps once."""

    revision: int
    gamma_max: int
    first_batch_size: int
    # Each entry's γ, a byte each (γ is at most 64).
    gammas: bytes
    # Each entry's exploit γ (NO_EXPLOIT where it has none); b"": the table has none.
    exploits: bytes = b""
    # Bit n set: step n was run and committed; reported again, it is a replay.
    ran: int = 0
    # Bit n set: step n's outcome was learned from; sent again, it is a replay.
    learned: int = 0

    @classmethod
    def of(cls, table: IssuedTable) -> KnownTable:
        gammas = bytes(choice.gamma for choice, _ in table.entries)
        exploits = bytes(NO_EXPLOIT if e is None else e[0].gamma for e in table.exploits)
        return cls(table.revision, table.gamma_max, table.first_batch_size, gammas, exploits)

    def entry_gamma(self, batch_size: int, exploited: bool = False) -> int | None:
        """The γ the entry for ``batch_size`` allows (its exploit's where ``exploited``);
        None where the table has no such entry."""
        index = batch_size - self.first_batch_size
        gammas = self.exploits if exploited else self.gammas
        gamma = gammas[index] if 0 <= index < len(gammas) else None
        return None if gamma == NO_EXPLOIT else gamma

    def has_run(self, step: int) -> bool:
        return step > 0 and bool(self.ran >> step & 1)

    def mark_run(self, step: int) -> None:
        self.ran |= 1 << step

    def has_learned(self, step: int) -> bool:
        return step > 0 and bool(self.learned >> step & 1)

    def mark_learned(self, step: int) -> None:
        self.learned |= 1 << step


def step_number(decision_id: str) -> int:
    """n of a ran step's id "<table_id>.<n>" (from 1); 0 when n is no short decimal number
    (a table serves at most TableOptions.valid_steps steps)."""
    number = decision_id.rpartition(".")[2]
    if not (number.isascii() and number.isdigit()) or len(number) > 9:
        return 0
    return int(number)


# Tables an engine's ran steps may commit: the newest few (a report batch names the table
# in use and, around a refresh, the one before). Older ones are remembered without their
# checkpoints (KNOWN_TABLES): a sidecar that falls behind may issue dozens of tables (each
# late request's) before an engine's report of the one it ran arrives, and those steps are
# still learned from.
KEPT_TABLES = 16
KNOWN_TABLES = 256


@dataclasses.dataclass(slots=True)
class EngineShard:
    engine_id: str
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    pending: collections.OrderedDict[str, PendingDecision] = dataclasses.field(
        default_factory=collections.OrderedDict
    )
    # Decision tables issued to the engine, oldest first (at most KEPT_TABLES), and what
    # is remembered of the last KNOWN_TABLES.
    tables: collections.OrderedDict[str, IssuedTable] = dataclasses.field(
        default_factory=collections.OrderedDict
    )
    known_tables: collections.OrderedDict[str, KnownTable] = dataclasses.field(
        default_factory=collections.OrderedDict
    )
    # A memory directive issued while applying ran steps, sent with the next table.
    directive: MemoryDirective = dataclasses.field(default_factory=MemoryDirective)
    # perf_counter of the engine's last request (the nightjar_engines gauge).
    last_seen: float = 0.0
    # How the engine runs speculation, as its last context said (GetState's engines_json).
    runtime: EngineRuntime | None = None
    min_draft_passes: int = 0
    # Estimated bytes of its pending decisions' contexts, and of its tables (kept and known).
    pending_bytes: int = 0
    table_bytes: int = 0
    # Estimated bytes of each kept table (table_bytes), by table id.
    kept_sizes: dict[str, int] = dataclasses.field(default_factory=dict)

    def saw(self, ctx: StepContext) -> None:
        if ctx.runtime is not None:
            self.runtime, self.min_draft_passes = ctx.runtime, ctx.min_draft_passes

    def runtime_view(self) -> dict[str, Any] | None:
        if self.runtime is None:
            return None
        return {**dataclasses.asdict(self.runtime), "min_draft_passes": self.min_draft_passes}


class EngineTable:
    """The shards, least recently used first, and the learner keys in use."""

    def __init__(self, bounds: Bounds, count_eviction: Callable[[str, int], None]) -> None:
        self.bounds = bounds
        self._count = count_eviction
        self._lock = threading.Lock()
        self._shards: collections.OrderedDict[str, EngineShard] = collections.OrderedDict()
        self._learner_keys: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Estimated bytes all engines hold in pending decisions and in tables (the shards'
        # sums), changed under _held_lock from any engine's thread.
        self._held_lock = threading.Lock()
        self.pending_bytes = 0
        self.table_bytes = 0

    def _hold(self, pending: int = 0, tables: int = 0) -> None:
        with self._held_lock:
            self.pending_bytes += pending
            self.table_bytes += tables

    def _release(self, shards: list[EngineShard]) -> None:
        """What shards no longer held held."""
        if shards:
            self._hold(
                pending=-sum(s.pending_bytes for s in shards),
                tables=-sum(s.table_bytes for s in shards),
            )

    def get(self, engine_id: str) -> EngineShard | None:
        return self._shards.get(engine_id)

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._shards

    def engine_ids(self) -> list[str]:
        with self._lock:
            return list(self._shards)

    def __len__(self) -> int:
        return len(self._shards)

    def learner_keys(self) -> int:
        return len(self._learner_keys)

    def shard(self, engine_id: str, learner_key: str = "") -> tuple[EngineShard, list[str]]:
        """The engine's shard, created when new and marked most recently used; with the
        engines and learner keys evicted to make room (the caller forgets their policy
        state)."""
        evicted: list[EngineShard] = []
        with self._lock:
            shard = self._shards.get(engine_id)
            if shard is None:
                shard = self._shards[engine_id] = EngineShard(engine_id)
                while len(self._shards) > self.bounds.max_engines:
                    evicted.append(self._shards.popitem(last=False)[1])
            else:
                self._shards.move_to_end(engine_id)
            shard.last_seen = time.perf_counter()
        if evicted:
            self._release(evicted)
            self._count(ENGINE, len(evicted))
        return shard, [old.engine_id for old in evicted]

    def use_learner_key(self, key: str) -> list[str]:
        """Mark ``key`` most recently used; the keys evicted to stay within the bound."""
        if not key:
            return []
        evicted: list[str] = []
        with self._lock:
            if key in self._learner_keys:
                self._learner_keys.move_to_end(key)
                return []
            self._learner_keys[key] = None
            while len(self._learner_keys) > self.bounds.max_learner_keys:
                evicted.append(self._learner_keys.popitem(last=False)[0])
        if evicted:
            self._count(LEARNER_KEY, len(evicted))
        return evicted

    def remove(self, engine_id: str) -> EngineShard | None:
        with self._lock:
            shard = self._shards.pop(engine_id, None)
        if shard is not None:
            self._release([shard])
        return shard

    def clear(self) -> None:
        with self._lock:
            shards = list(self._shards.values())
            self._shards.clear()
            self._learner_keys.clear()
        self._release(shards)

    def pending_refusal(self, shard: EngineShard, size: int) -> str:
        """Under the shard's lock: why a decision whose context takes ``size`` bytes
        cannot await its outcome ("" when it can; Bounds.pending_refusal)."""
        return self.bounds.pending_refusal(size, shard.pending_bytes, self.pending_bytes)

    def add_pending(self, shard: EngineShard, decision_id: str, pending: PendingDecision) -> None:
        """Under the shard's lock: a committed decision awaits its outcome; the engine's
        oldest go (evicted, counted) past its count and byte bounds, and while all
        engines' pending decisions are past theirs (pending_refusal was asked first)."""
        bounds = self.bounds
        shard.pending[decision_id] = pending
        shard.pending_bytes += pending.size
        self._hold(pending=pending.size)
        evicted = 0
        while len(shard.pending) > 1 and (
            len(shard.pending) > bounds.max_pending_per_engine
            or shard.pending_bytes > bounds.max_pending_bytes_per_engine
            or self.pending_bytes > bounds.max_pending_bytes
        ):
            _, old = shard.pending.popitem(last=False)
            shard.pending_bytes -= old.size
            self._hold(pending=-old.size)
            evicted += 1
        if evicted:
            self._count(PENDING, evicted)

    def take_pending(self, shard: EngineShard, decision_id: str) -> None:
        pending = shard.pending.pop(decision_id)
        shard.pending_bytes -= pending.size
        self._hold(pending=-pending.size)

    def keep_table(self, shard: EngineShard, table_id: str, table: IssuedTable) -> None:
        """Under the shard's lock: remember a table issued to the engine; the oldest kept
        go past KEPT_TABLES or the engine's table bytes (the newest is always kept), the
        oldest remembered past KNOWN_TABLES."""
        size = table_bytes(table)
        known = KnownTable.of(table)
        held = size + KNOWN_TABLE_BYTES + len(known.gammas)
        shard.tables[table_id] = table
        shard.kept_sizes[table_id] = size
        shard.known_tables[table_id] = known
        while len(shard.tables) > 1 and (
            len(shard.tables) > KEPT_TABLES
            or sum(shard.kept_sizes.values()) > self.bounds.max_table_bytes_per_engine
        ):
            dropped, _ = shard.tables.popitem(last=False)
            held -= shard.kept_sizes.pop(dropped)
        while len(shard.known_tables) > KNOWN_TABLES:
            _, old = shard.known_tables.popitem(last=False)
            held -= KNOWN_TABLE_BYTES + len(old.gammas)
        shard.table_bytes += held
        self._hold(tables=held)

    def seen_since(self, since: float) -> int:
        """Engines seen at or after ``since`` (perf_counter)."""
        with self._lock:
            return sum(1 for shard in self._shards.values() if shard.last_seen >= since)
