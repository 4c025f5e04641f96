"""The memory agent: carries out draft offload/reload and KV expand/compact orders at step
boundaries, and knows the state they leave behind.

Orders come from the sidecar (directives riding on decisions) and from operators (the
memory-agent gRPC service). They queue here and run one at a time, each in two halves:

* **pool half** — on the scheduler's thread, at the start of a ``schedule()`` call, before
  any block is allocated: grow or shrink the usable KV pool (:class:`KVPool`); a shrink
  returns the migration plan of the live blocks above the new size;
* **worker half** — in the worker, at the start of that step's ``execute_model``, before
  the forward pass: copy the migrated blocks, re-point the block tables, offload the draft
  or start its reload (:class:`DraftDevice`). The plan travels with the step's
  ``SchedulerOutput`` (:class:`WorkerOrder`), so the worker applies exactly what the
  scheduler decided, in step order.

A reload is verified before the draft counts as resident: where the copy runs
asynchronously (CUDA side stream) it is finished and checked at the next boundary, so it
overlaps a forward pass. While the draft is not resident the engine may only run γ = 0
(:attr:`MemoryAgent.draft_resident`) and the drafter does not run at all.

Nothing here imports vLLM; ``vllm_client_patch/kv_pool.py`` and
``vllm_client_patch/worker_memory.py`` adapt vLLM's objects to the two protocols below.

One module: the order queue and the two halves of each order share the agent's state and
lock.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from memory_agent.draft_weights import ReloadError, Transfer
from memory_agent.orders import Action, Order, WorkerOrder
from memory_agent.planner import MigrationPlan, Move, PlanError
from nightjar_common.errors import FailedPreconditionError, InvalidArgumentError, NightjarError
from nightjar_common.types import DraftState

if TYPE_CHECKING:
    from memory_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)


class KVPool(Protocol):
    """The scheduler's KV block pool, as the agent needs it."""

    def free_blocks(self) -> int:
        """Blocks free for allocation within the usable pool."""
        ...

    def resize(self, num_blocks: int) -> MigrationPlan:
        """Make ids ``< num_blocks`` the usable pool. Growing hands the new ids out as free
        blocks; shrinking re-points every live block above the size at a free id below it
        (block tables included) and returns the plan whose copies the worker must run.
        Raises :class:`PlanError` (and changes nothing) when the live blocks do not fit."""
        ...


class DraftDevice(Protocol):
    """The worker's draft weights, KV buffers and block tables."""

    def offload_draft(self) -> Transfer: ...

    def start_reload(self) -> Transfer:
        """Begin the reload; the copy may still be running when this returns."""
        ...

    @property
    def reload_is_async(self) -> bool:
        """True when :meth:`start_reload` returns before the copy has finished."""
        ...

    def finish_reload(self) -> Transfer:
        """Wait for the copy and verify it; :class:`ReloadError` if it does not match."""
        ...

    def migrate(self, waves: tuple[tuple[Move, ...], ...], remap: Mapping[int, int]) -> None:
        """Copy KV blocks wave by wave and re-point the worker's block tables."""
        ...


@dataclasses.dataclass(slots=True)
class _Ticket:
    order: Order
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: NightjarError | None = None
    # Time the order held the engine at step boundaries (pool half + worker half).
    held_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryStatus:
    draft_state: str
    draft_bytes: int
    draft_blocks: int
    kv_blocks: int
    free_kv_blocks: int
    capacity_blocks: int
    pending_action: str
    last_error: str
    offloads: int
    reloads: int
    failed_reloads: int
    migrated_blocks: int
    last_order_ms: float

    @property
    def draft_resident(self) -> bool:
        return self.draft_state == DraftState.RESIDENT.value


class MemoryAgent:
    """One per engine. Thread-safe: orders arrive from gRPC threads and the plugin; the
    pool half runs on the scheduler's thread and the worker half on the worker's."""

    def __init__(
        self,
        capacity_blocks: int,
        block_bytes: int,
        draft_bytes: int,
        compaction_supported: bool = True,
        offload_blocker: str = "",
        draft_blocks: int | None = None,
    ) -> None:
        """``draft_blocks``: S_draft when the draft lives in the buffer's top blocks
        (draft_slot.py); otherwise the draft's bytes in blocks, rounded up."""
        self.metrics: AgentMetrics | None = None
        if capacity_blocks < 2 or block_bytes <= 0:
            raise ValueError("need a KV pool of at least 2 blocks and a positive block size")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.draft_bytes = draft_bytes
        self.compaction_supported = compaction_supported
        # Why the draft can never be offloaded on this engine ("" when it can): its share of
        # the buffer is then KV from the start.
        self.offload_blocker = offload_blocker
        # S_draft in blocks: what offloading the draft is worth to the KV pool.
        if draft_blocks is None:
            draft_blocks = math.ceil(draft_bytes / block_bytes)
        self.draft_blocks = 0 if offload_blocker else min(draft_blocks, capacity_blocks - 2)
        # The usable pool starts without the draft's share (the draft is resident).
        self.kv_blocks = capacity_blocks - self.draft_blocks
        self._state = DraftState.RESIDENT
        self.pool: KVPool | None = None
        self._lock = threading.Lock()
        self._queue: collections.deque[_Ticket] = collections.deque()
        self._current: _Ticket | None = None  # pool half done, worker half not yet
        self._reload_in_flight = False
        self._half_started = 0.0  # when the running half of the current order began
        self.last_error = ""
        self.offloads = self.reloads = self.failed_reloads = self.migrated_blocks = 0
        # (action, seconds it held the engine, error or "") of recent orders, oldest first.
        self.history: collections.deque[tuple[str, float, str]] = collections.deque(maxlen=64)

    @property
    def state(self) -> DraftState:
        return self._state

    @state.setter
    def state(self, state: DraftState) -> None:
        self._state = state
        if self.metrics is not None:
            self.metrics.draft_resident.set(1.0 if state is DraftState.RESIDENT else 0.0)

    def attach_metrics(self, metrics: AgentMetrics | None) -> None:
        """Count orders and follow the draft's state in ``metrics`` from now on."""
        self.metrics = metrics
        self.state = self._state  # the gauge starts at the current state

    # -- orders ---------------------------------------------------------------------------

    def submit(self, order: Order) -> _Ticket:
        """Queue an order for the next step boundary. Targets are checked now
        (INVALID_ARGUMENT); whether the order can run is checked when it runs."""
        self._check_target(order)
        ticket = _Ticket(order)
        with self._lock:
            self._queue.append(ticket)
        log.info(
            "nightjar memory: %s queued (%s%s)",
            order.action.value,
            order.source,
            f": {order.reason}" if order.reason else "",
        )
        return ticket

    def offer_directive(self, order: Order) -> None:
        """A sidecar directive: queued unless the same action is already queued or running,
        or the draft is already where the directive wants it (the sidecar then learns the
        state from the next step's context)."""
        with self._lock:
            busy = [t.order.action for t in self._queue]
            if self._current is not None:
                busy.append(self._current.order.action)
            wanted = {
                Action.OFFLOAD_DRAFT: DraftState.RESIDENT,
                Action.RELOAD_DRAFT: DraftState.OFFLOADED,
            }
        if order.action in busy or self.state is not wanted.get(order.action, self.state):
            return
        self.submit(order)

    def wait(self, ticket: _Ticket, timeout: float) -> bool:
        """True once the order has run (then ``ticket.error`` says whether it failed)."""
        return ticket.done.wait(timeout)

    def _check_target(self, order: Order) -> None:
        if order.action not in (Action.EXPAND_KV, Action.COMPACT_KV):
            return
        target = order.target_kv_blocks
        if not 2 <= target <= self.capacity_blocks:
            raise InvalidArgumentError(
                f"target_kv_blocks must be in [2, {self.capacity_blocks}] "
                f"(the KV buffer's capacity), got {target}"
            )

    # -- pool half (scheduler thread) -----------------------------------------------------

    def begin_step(self, pool: KVPool) -> WorkerOrder | None:
        """Run the next order's pool half; the worker half to send with this step."""
        self.pool = pool
        with self._lock:
            if self._current is not None or not self._queue:
                return None
            ticket = self._queue.popleft()
        self._half_started = time.perf_counter()
        try:
            work = self._pool_half(ticket.order, pool)
        except NightjarError as exc:
            self._complete(ticket, exc)
            return None
        if work is None:
            self._complete(ticket, None)
            return None
        ticket.held_s += time.perf_counter() - self._half_started
        with self._lock:
            self._current = ticket
        return work

    def _pool_half(self, order: Order, pool: KVPool) -> WorkerOrder | None:
        action = order.action
        if action is Action.OFFLOAD_DRAFT:
            self._require(DraftState.RESIDENT, "offload")
            if order.resize_kv:
                self._resize(pool, self.capacity_blocks)
            self.state = DraftState.OFFLOADING
            return WorkerOrder(offload_draft=True)
        if action is Action.RELOAD_DRAFT:
            self._require(DraftState.OFFLOADED, "reload")
            limit = self.capacity_blocks - self.draft_blocks
            plan = MigrationPlan({}, [])
            if self.kv_blocks > limit:
                if not order.resize_kv:
                    raise FailedPreconditionError(
                        f"the KV pool ({self.kv_blocks} blocks) uses the draft's memory: "
                        f"compact it to {limit} first (compact_kv)"
                    )
                plan = self._resize(pool, limit)
            self.state = DraftState.RELOADING
            return self._worker_order(plan, reload_draft=True)
        target = order.target_kv_blocks
        if action is Action.EXPAND_KV:
            limit = self.capacity_blocks - (
                0 if self.state is DraftState.OFFLOADED else self.draft_blocks
            )
            if target < self.kv_blocks:
                raise InvalidArgumentError(
                    f"ExpandKv to {target} blocks would shrink the pool "
                    f"({self.kv_blocks} blocks): use CompactKv"
                )
            if target > limit:
                raise FailedPreconditionError(
                    f"cannot grow the KV pool to {target} blocks: {limit} is the limit while "
                    f"the draft is {self.state.value} ({self.draft_blocks} blocks are its)"
                )
            self._resize(pool, target)
            return None
        if target > self.kv_blocks:
            raise InvalidArgumentError(
                f"CompactKv to {target} blocks would grow the pool ({self.kv_blocks} blocks): "
                "use ExpandKv"
            )
        plan = self._resize(pool, target)
        return self._worker_order(plan) if plan.mapping else None

    def _require(self, state: DraftState, verb: str) -> None:
        if self.offload_blocker:
            raise FailedPreconditionError(f"cannot {verb}: {self.offload_blocker}")
        if self.draft_blocks <= 0:
            raise FailedPreconditionError(f"cannot {verb}: this engine has no draft weights")
        if self.state is not state:
            raise FailedPreconditionError(
                f"cannot {verb} a draft that is {self.state.value} (needs {state.value})"
            )

    def _resize(self, pool: KVPool, num_blocks: int) -> MigrationPlan:
        if num_blocks < self.kv_blocks and not self.compaction_supported:
            raise FailedPreconditionError(
                "this engine's KV layout (split kernel blocks) does not support compaction"
            )
        try:
            plan = pool.resize(num_blocks)
        except PlanError as exc:
            raise FailedPreconditionError(f"cannot shrink the KV pool: {exc}") from exc
        log.info(
            "nightjar memory: KV pool %d -> %d blocks (%d moved)",
            self.kv_blocks,
            num_blocks,
            len(plan.mapping),
        )
        self.kv_blocks = num_blocks
        self.migrated_blocks += len(plan.mapping)
        return plan

    @staticmethod
    def _worker_order(plan: MigrationPlan, reload_draft: bool = False) -> WorkerOrder:
        waves = tuple(tuple(wave) for wave in plan.waves)
        return WorkerOrder(waves, dict(plan.mapping), reload_draft=reload_draft)

    # -- worker half (worker thread) ------------------------------------------------------

    def worker_step(self, device: DraftDevice, work: WorkerOrder | None) -> None:
        """At the start of a step in the worker: finish a reload begun at the previous
        boundary, then carry out this step's order."""
        if self._reload_in_flight:
            self._half_started = time.perf_counter()
            self._finish_reload(device)
        if work is None:
            return
        self._half_started = time.perf_counter()
        self._worker_half(device, work)
        if self._current is not None:  # a reload still copying: finished next boundary
            self._current.held_s += time.perf_counter() - self._half_started

    def _worker_half(self, device: DraftDevice, work: WorkerOrder) -> None:
        if work.waves:
            device.migrate(work.waves, work.remap)
        if work.offload_draft:
            moved = device.offload_draft()
            self.state = DraftState.OFFLOADED
            self.offloads += 1
            log.info(
                "nightjar memory: draft offloaded (%d MiB in %.1f ms)",
                moved.bytes >> 20,
                moved.call_seconds * 1e3,
            )
            self._complete_current(None)
        elif work.reload_draft:
            device.start_reload()
            self._reload_in_flight = True
            if not device.reload_is_async:
                self._finish_reload(device)
        else:
            self._complete_current(None)

    def _finish_reload(self, device: DraftDevice) -> None:
        self._reload_in_flight = False
        try:
            moved = device.finish_reload()
        except ReloadError as exc:
            self.state = DraftState.OFFLOADED
            self.failed_reloads += 1
            log.error("nightjar memory: %s; speculation stays off", exc)
            self._complete_current(FailedPreconditionError(str(exc)))
            return
        self.state = DraftState.RESIDENT
        self.reloads += 1
        log.info(
            "nightjar memory: draft reloaded and verified (%d MiB, verify %.1f ms)",
            moved.bytes >> 20,
            moved.call_seconds * 1e3,
        )
        self._complete_current(None)

    def _complete_current(self, error: NightjarError | None) -> None:
        with self._lock:
            ticket, self._current = self._current, None
        if ticket is not None:
            self._complete(ticket, error)

    def _complete(self, ticket: _Ticket, error: NightjarError | None) -> None:
        ticket.error = error
        self.last_error = str(error) if error else ""
        ticket.held_s += time.perf_counter() - self._half_started
        self.history.append((ticket.order.action.value, ticket.held_s, self.last_error))
        if self.metrics is not None:
            self.metrics.order_done(ticket.order.action, error is not None, ticket.held_s)
        if error is not None:
            log.warning("nightjar memory: %s failed: %s", ticket.order.action.value, error)
        ticket.done.set()

    # -- views ----------------------------------------------------------------------------

    @property
    def draft_resident(self) -> bool:
        """Speculation is allowed only while this holds."""
        return self.state is DraftState.RESIDENT

    def status(self) -> MemoryStatus:
        with self._lock:
            pending = [t.order.action.value for t in self._queue]
            if self._current is not None:
                pending.insert(0, self._current.order.action.value)
        free = self.pool.free_blocks() if self.pool is not None else self.kv_blocks - 1
        return MemoryStatus(
            draft_state=self.state.value,
            draft_bytes=self.draft_bytes,
            draft_blocks=self.draft_blocks,
            kv_blocks=self.kv_blocks,
            free_kv_blocks=free,
            capacity_blocks=self.capacity_blocks,
            pending_action=",".join(pending),
            last_error=self.last_error,
            offloads=self.offloads,
            reloads=self.reloads,
            failed_reloads=self.failed_reloads,
            migrated_blocks=self.migrated_blocks,
            last_order_ms=1e3 * self.history[-1][1] if self.history else 0.0,
        )
