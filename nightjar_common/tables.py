"""The client's side of decision tables: the newest table it holds and the
steps it ran from it, used on the engine's thread without a lock or a round trip.

The sidecar decides the γ of every batch size the engine can reach next at once and
sends them as a GammaTable; the engine answers each step from it (:meth:`TableCache.take`)
and reports what it ran in batches (:class:`ReportBatch`). A table is used for steps that
start in its speculation state, within its size range, for at most ``valid_steps`` steps
and ``valid_ms`` milliseconds; an exploring entry (a trial, or a draw away from the greedy
γ) runs once, and after that the γ the policy exploits there where the table names it.
Anything else is a miss: the client asks for a new table.

Threads: the stream's reader installs tables (:meth:`TableCache.install`), the engine's
thread takes from them. Each installed table gets a fresh :class:`HeldTable`, swapped in
with one assignment; only the engine's thread changes a held table's use counts.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from typing import Protocol, TypeVar

from nightjar_common.types import GammaTable, RanStep, StepContext, StepOutcome

# Why a step found no usable entry (ClientStats.table_misses).
NO_TABLE = "no_table"
OUT_OF_RANGE = "batch_size"
OTHER_STATE = "speculation_state"
SPENT = "exploring_spent"
EXPIRED = "expired"  # older than valid_ms
USED_UP = "used_up"  # served valid_steps steps

T = TypeVar("T")

# A batch within this many sizes of a table's edge asks for the next table (the edge at
# batch size 1 excepted): a batch that drifts leaves a table in a few steps, and the step
# that left it would wait a round trip.
EDGE_MARGIN = 2


@dataclasses.dataclass(slots=True)
class HeldTable:
    """A table as the engine uses it: when it first served, how often, which of its
    exploring entries already ran."""

    table: GammaTable
    # The request's sequence number (a newer table replaces an older one).
    seq: int
    # time.monotonic() of its first step: a table's time runs while it serves, so one asked
    # for as the engine went idle is there when it wakes (a policy change voids it, a lost
    # sidecar too; a sidecar frozen meanwhile costs its valid_ms after the wake-up).
    started: float | None = None
    uses: int = 0
    spent: set[int] = dataclasses.field(default_factory=set)
    # The sidecar connection it came on (TableCache.connection when installed).
    connection: int = 0
    # time.monotonic() from which it serves no step: started + valid_ms (before its first
    # step, never, unless valid_ms says it is void).
    expires: float = dataclasses.field(init=False)
    # Worked out once per table (by the thread installing it), not on each step: the batch
    # sizes of its entries; the speculation state its entries serve (None: either); each
    # entry's exploring flag; each entry's exploit γ (None: the table has none; -1: the
    # entry has none); the sizes not near its edges (refresh_due).
    sizes: range = dataclasses.field(init=False)
    state: bool | None = dataclasses.field(init=False)
    explores: tuple[bool, ...] = dataclasses.field(init=False)
    exploits: tuple[int, ...] | None = dataclasses.field(init=False)
    inner: range = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        table = self.table
        self.expires = math.inf if table.valid_ms > 0 else -math.inf
        first, count = table.first_batch_size, len(table.gammas)
        self.sizes = range(first, first + count)
        self.state = None if table.any_speculation_state else table.speculation_off
        self.explores = tuple(table.exploring[:count]) + (False,) * (count - len(table.exploring))
        exploits = table.exploit_gammas
        self.exploits = tuple(exploits) if len(exploits) == count else None
        # The edge at batch size 1 excepted (no batch is smaller).
        self.inner = range(first + (EDGE_MARGIN if first > 1 else 0), first + count - EDGE_MARGIN)

    def age_ms(self, now: float) -> float:
        return 0.0 if self.started is None else 1000.0 * (now - self.started)

    def index(self, batch_size: int, speculation_off: bool) -> int | str:
        """The entry for a step of ``batch_size`` (after a step at γ = 0 when
        ``speculation_off``), or why the table has none for it."""
        sizes = self.sizes
        if batch_size not in sizes:
            return OUT_OF_RANGE
        state = self.state
        if state is not None and speculation_off != state:
            return OTHER_STATE
        return batch_size - sizes.start


@dataclasses.dataclass(slots=True)
class TableStep:
    """One step answered from a table: the γ, whether its entry explores, the table,
    which of the table's steps it was (its decision id, formatted when reported), and
    whether it ran the exploit γ of an exploring entry that had run."""

    gamma: int
    exploring: bool
    held: HeldTable
    use: int
    exploited: bool = False

    @property
    def decision_id(self) -> str:
        """The id the step is reported with: "<table_id>.<n>"."""
        return f"{self.held.table.table_id}.{self.use}"


class TableCache:
    """The newest table; what a step runs from it."""

    def __init__(self) -> None:
        self.held: HeldTable | None = None
        # Counts the sidecar connections lost (forget): a table of an earlier one is
        # unknown to the sidecar now.
        self.connection = 0

    def install(self, table: GammaTable, seq: int) -> bool:
        """Hold ``table`` unless it, or a newer one (a later request's), is held already
        (the reply to a blocking request reaches both its waiter and its callback: a second
        install would reset the table's use counts)."""
        held = self.held
        if held is not None and held.seq >= seq:
            return False
        self.held = HeldTable(table, seq, connection=self.connection)
        return True

    def void(self) -> None:
        """Drop the held table (a policy change: its steps are still reported)."""
        self.held = None

    def forget(self) -> None:
        """Drop the held table and mark every table so far as of a lost connection (the
        sidecar answering next does not know them: their steps are not reported)."""
        self.connection += 1
        self.held = None

    def current(self, held: HeldTable) -> bool:
        """Whether ``held`` came on the present connection."""
        return held.connection == self.connection

    def take(self, ctx: StepContext, now: float) -> TableStep | str:
        """The entry for ``ctx``'s step, counted as used; else why there is none."""
        return self.take_size(ctx.batch_size, ctx.previous_gamma == 0, now)

    def take_size(self, batch_size: int, speculation_off: bool, now: float) -> TableStep | str:
        """The entry for a step of ``batch_size`` (after a step at γ = 0 when
        ``speculation_off``), counted as used; else why there is none."""
        held = self.held
        if held is None:
            return NO_TABLE
        index = held.index(batch_size, speculation_off)
        if isinstance(index, str):
            return index
        table = held.table
        if held.uses >= table.valid_steps:
            return USED_UP
        if now >= held.expires:
            return EXPIRED
        exploring = held.explores[index]
        if exploring:
            if index in held.spent:
                exploits = held.exploits
                if exploits is None or exploits[index] < 0:
                    return SPENT
                held.uses += 1
                return TableStep(exploits[index], False, held, held.uses, True)
            held.spent.add(index)
        if held.started is None:
            held.started = now
            held.expires = now + table.valid_ms / 1000.0
        held.uses += 1
        return TableStep(table.gammas[index], exploring, held, held.uses)


@dataclasses.dataclass(slots=True)
class NextStep:
    """The step a table is wanted for, as the engine's thread knows it: the step after
    ``ctx``'s, which ran at ``gamma`` (or ``ctx``'s own step when ``gamma`` is None). Its
    context is built only for a request that carries it, off the engine's thread."""

    ctx: StepContext
    gamma: int | None = None

    @property
    def batch_size(self) -> int:
        return self.ctx.batch_size

    @property
    def speculation_off(self) -> bool:
        previous = self.ctx.previous_gamma if self.gamma is None else self.gamma
        return previous == 0

    def context(self) -> StepContext:
        if self.gamma is None:
            return self.ctx
        ctx = self.ctx
        return dataclasses.replace(ctx, step_index=ctx.step_index + 1, previous_gamma=self.gamma)


@dataclasses.dataclass(slots=True)
class LazyStep:
    """A step a table is wanted for, as :class:`NextStep` is, given by its batch size and
    speculation state and a function that builds its context: called only for a request
    that carries it, on the sender's thread (nothing built on the engine's)."""

    batch_size: int
    speculation_off: bool
    build: Callable[[], StepContext]

    def context(self) -> StepContext:
        return self.build()


AheadStep = NextStep | LazyStep


def refresh_due(
    held: HeldTable | None,
    batch_size: int,
    speculation_off: bool,
    now: float,
    every_steps: int,
    every_ms: float,
) -> bool:
    """Whether to ask for a new table now, so that it is there for a step of
    ``batch_size`` (after a step at γ = 0 when ``speculation_off``): the held one has
    served ``every_steps`` steps or is ``every_ms`` old, or will not answer that step (its
    batch size or speculation state is not the table's, or its entry explored already and
    the table names no exploit γ), or the step's batch size is near the table's edge."""
    if held is None or held.uses >= every_steps or batch_size not in held.inner:
        return True  # no table, one that served its steps, or a size at or past its edge
    state = held.state
    if state is not None and speculation_off != state:
        return True
    index = batch_size - held.sizes.start
    if index in held.spent and (held.exploits is None or held.exploits[index] < 0):
        return True
    return held.age_ms(now) >= every_ms


class ReportSource(Protocol):
    """Reports a caller deferred: queued on the client (its ``ran`` and ``report``) when
    asked, by the thread about to send a batch, so that a table request carries every
    step run before it."""

    def settle(self) -> None: ...


class ReportBatch:
    """Steps run from tables and outcomes, queued by the engine's thread and taken whole
    by whoever sends the next request (deque appends and pops are thread-safe)."""

    def __init__(self) -> None:
        self._ran: collections.deque[RanStep] = collections.deque()
        self._outcomes: collections.deque[StepOutcome] = collections.deque()

    def ran(self, step: RanStep) -> None:
        self._ran.append(step)

    def outcome(self, outcome: StepOutcome) -> None:
        self._outcomes.append(outcome)

    @property
    def outcomes(self) -> int:
        return len(self._outcomes)

    def __len__(self) -> int:
        return len(self._ran) + len(self._outcomes)

    def drain(self, limit: int) -> tuple[list[RanStep], list[StepOutcome]]:
        """Up to ``limit`` of each, oldest first."""
        return _pop(self._ran, limit), _pop(self._outcomes, limit)

    def clear(self) -> None:
        self._ran.clear()
        self._outcomes.clear()


def _pop(queue: collections.deque[T], limit: int) -> list[T]:
    taken: list[T] = []
    while queue and len(taken) < limit:
        taken.append(queue.popleft())
    return taken
