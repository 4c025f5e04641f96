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

from nightjar_common.types import Choice, EngineRuntime, MemoryDirective, StepContext

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

    def __post_init__(self) -> None:
        for name in ("max_engines", "max_learner_keys", "max_pending_per_engine"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclasses.dataclass(frozen=True, slots=True)
class PendingDecision:
    ctx: StepContext
    choice: Choice
    revision: int
    gamma_max: int


@dataclasses.dataclass(frozen=True, slots=True)
class IssuedTable:
    """A decision table as the sidecar keeps it until the engine reports its steps: per
    batch size, the choice and the policy's checkpoint after it (committed by the step
    that runs it)."""

    revision: int
    gamma_max: int
    first_batch_size: int
    entries: tuple[tuple[Choice, object], ...]

    def entry(self, batch_size: int) -> tuple[Choice, object] | None:
        index = batch_size - self.first_batch_size
        return self.entries[index] if 0 <= index < len(self.entries) else None


@dataclasses.dataclass(slots=True)
class KnownTable:
    """What the sidecar remembers of a table it issued, kept or not: enough to check a
    step run from it (the γ each entry allowed) and to learn each of its steps once."""

    revision: int
    gamma_max: int
    first_batch_size: int
    # Each entry's γ, a byte each (γ is at most 64).
    gammas: bytes
    # Bit n set: step n was run and committed; reported again, it is a replay.
    ran: int = 0
    # Bit n set: step n's outcome was learned from; sent again, it is a replay.
    learned: int = 0

    @classmethod
    def of(cls, table: IssuedTable) -> KnownTable:
        gammas = bytes(choice.gamma for choice, _ in table.entries)
        return cls(table.revision, table.gamma_max, table.first_batch_size, gammas)

    def entry_gamma(self, batch_size: int) -> int | None:
        index = batch_size - self.first_batch_size
        return self.gammas[index] if 0 <= index < len(self.gammas) else None

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
        evicted: list[str] = []
        with self._lock:
            shard = self._shards.get(engine_id)
            if shard is None:
                shard = self._shards[engine_id] = EngineShard(engine_id)
                while len(self._shards) > self.bounds.max_engines:
                    _, old = self._shards.popitem(last=False)
                    evicted.append(old.engine_id)
            else:
                self._shards.move_to_end(engine_id)
            shard.last_seen = time.perf_counter()
        if evicted:
            self._count(ENGINE, len(evicted))
        return shard, evicted

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
            return self._shards.pop(engine_id, None)

    def clear(self) -> None:
        with self._lock:
            self._shards.clear()
            self._learner_keys.clear()

    def add_pending(self, shard: EngineShard, decision_id: str, pending: PendingDecision) -> None:
        """Under the shard's lock: a committed decision awaits its outcome."""
        shard.pending[decision_id] = pending
        if len(shard.pending) > self.bounds.max_pending_per_engine:
            shard.pending.popitem(last=False)
            self._count(PENDING, 1)

    def take_pending(self, shard: EngineShard, decision_id: str) -> None:
        del shard.pending[decision_id]

    def keep_table(self, shard: EngineShard, table_id: str, table: IssuedTable) -> None:
        """Under the shard's lock: remember a table issued to the engine."""
        shard.tables[table_id] = table
        shard.known_tables[table_id] = KnownTable.of(table)
        while len(shard.tables) > KEPT_TABLES:
            shard.tables.popitem(last=False)
        while len(shard.known_tables) > KNOWN_TABLES:
            shard.known_tables.popitem(last=False)

    def seen_since(self, since: float) -> int:
        """Engines seen at or after ``since`` (perf_counter)."""
        with self._lock:
            return sum(1 for shard in self._shards.values() if shard.last_seen >= since)
